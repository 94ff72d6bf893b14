"""Regenerate the sample data files in this folder (deterministic; nothing is downloaded).

    python data/samples/make_samples.py

Writes: math.jsonl, math.parquet, math_responses.jsonl, corpus.jsonl, qa.jsonl,
search_responses.jsonl. The search responses embed real BM25 results over corpus.jsonl, so
regenerating them needs bm25s.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# (data_source, problem, answer, an equivalent answer in another form, a wrong answer)
MATH = [
    ("gsm_style", "Tom has 3 boxes with 12 apples each. He gives away 7 apples. How many apples does he have left?", "29", "29 \\text{ apples}", "36"),
    ("gsm_style", "A train travels at 60 miles per hour for 2.5 hours. How many miles does it travel?", "150", "150\\text{ miles}", "120"),
    ("gsm_style", "Sara buys 4 notebooks at $3 each and a pen for $2. How many dollars does she spend?", "14", "\\$14", "12"),
    ("gsm_style", "A class has 28 students. If 3/4 of them passed a test, how many students passed?", "21", "21.0", "7"),
    ("gsm_style", "A baker makes 5 dozen cookies and sells 37 of them. How many cookies are left?", "23", "23", "13"),
    ("gsm_style", "Jake reads 15 pages a day. How many days does he need to finish a 240-page book?", "16", "16 \\text{ days}", "15"),
    ("gsm_style", "A rectangle has length 9 cm and width 4 cm. What is its area in square centimeters?", "36", "36", "26"),
    ("gsm_style", "Maria saves $25 every week. How many dollars has she saved after 8 weeks?", "200", "200.00", "225"),
    ("gsm_style", "A shirt costs $40 and is on sale for 25% off. What is the sale price in dollars?", "30", "\\$30", "10"),
    ("gsm_style", "How many days are there in 13 weeks?", "91", "91", "84"),
    ("gsm_style", "A pizza is cut into 8 slices. Three friends each eat 2 slices. How many slices remain?", "2", "2", "6"),
    ("gsm_style", "A car uses 1 gallon of gas every 30 miles. How many gallons does it use to drive 450 miles?", "15", "15", "13.5"),
    ("math_style", "Simplify $\\frac{6}{8}$.", "\\frac{3}{4}", "0.75", "\\frac{6}{8}+1"),
    ("math_style", "Write $\\sqrt{50}$ in simplest radical form.", "5\\sqrt{2}", "\\sqrt{50}", "25\\sqrt{2}"),
    ("math_style", "Solve for $x$: $2x + 7 = 19$.", "6", "x = 6", "13"),
    ("math_style", "Compute $\\binom{6}{2}$.", "15", "15", "30"),
    ("math_style", "What is the sum of the interior angles of a hexagon, in degrees?", "720", "720^\\circ", "540"),
    ("math_style", "Find the slope of the line through $(1, 2)$ and $(3, 8)$.", "3", "\\frac{6}{2}", "\\frac{1}{3}"),
    ("math_style", "Expand $(x+1)^2$.", "x^2+2x+1", "1 + 2x + x^{2}", "x^2+1"),
    ("math_style", "Write $0.125$ as a common fraction.", "\\frac{1}{8}", "1/8", "\\frac{1}{4}"),
    ("math_style", "Find all real solutions of $x^2 - 5x + 6 = 0$.", "\\{2,3\\}", "2, 3", "\\{-2,-3\\}"),
    ("math_style", "Evaluate $\\log_2 64$.", "6", "6", "8"),
    ("math_style", "What is the remainder when $2^{10}$ is divided by 7?", "2", "2", "4"),
    ("math_style", "Write the set of all real $x$ with $-1 < x \\le 4$ in interval notation.", "(-1, 4]", "(-1,4]", "[-1, 4)"),
    ("competition_style", "How many positive divisors does 360 have?", "24", "24", "12"),
    ("competition_style", "What is the sum of the first 50 positive odd integers?", "2500", "2{,}500", "2550"),
    ("competition_style", "How many trailing zeros does $100!$ have?", "24", "24", "20"),
    ("competition_style", "What is the smallest positive integer $n$ such that $n!$ is divisible by 1000?", "15", "15", "10"),
    ("competition_style", "Compute $1 + 2 + \\cdots + 100$.", "5050", "5{,}050", "5000"),
    ("competition_style", "In how many ways can 5 distinct books be arranged on a shelf?", "120", "5!", "25"),
    ("competition_style", "Find the greatest common divisor of 252 and 198.", "18", "18", "6"),
    ("competition_style", "Compute $\\frac{1}{2} + \\frac{1}{3} + \\frac{1}{6}$.", "1", "\\frac{6}{6}", "\\frac{3}{11}"),
    ("competition_style", "A fair die is rolled twice. What is the probability that the sum is 7? Express your answer as a common fraction.", "\\frac{1}{6}", "\\frac{6}{36}", "\\frac{7}{36}"),
    ("competition_style", "Compute $7^4$.", "2401", "2{,}401", "2041"),
    ("competition_style", "Find the area of a triangle with side lengths 3, 4 and 5.", "6", "6.0", "12"),
    ("competition_style", "Find $x$ such that $3^{x} = 81$.", "4", "4", "27"),
]

CORPUS = [
    ("Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after the engineer Gustave Eiffel, whose company designed and built the tower for the 1889 World's Fair."),
    ("Paris", "Paris is the capital and most populous city of France. The city is situated on the river Seine, in the north of the country."),
    ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level, located in the Mahalangur Himal sub-range of the Himalayas. Its elevation is about 8,849 metres."),
    ("Pacific Ocean", "The Pacific Ocean is the largest and deepest of Earth's five oceanic divisions. It extends from the Arctic Ocean in the north to the Southern Ocean in the south."),
    ("Amazon River", "The Amazon River in South America is the largest river in the world by discharge volume of water. It flows through Peru, Colombia and Brazil into the Atlantic Ocean."),
    ("Marie Curie", "Marie Curie was a Polish and naturalised-French physicist and chemist who conducted pioneering research on radioactivity. She was born in Warsaw in 1867. She was the first woman to win a Nobel Prize and the only person to win Nobel Prizes in two scientific fields."),
    ("Warsaw", "Warsaw is the capital and largest city of Poland. It stands on the Vistula River in east-central Poland."),
    ("Albert Einstein", "Albert Einstein was a German-born theoretical physicist who developed the theory of relativity. He received the 1921 Nobel Prize in Physics for his explanation of the photoelectric effect. He was born in Ulm in 1879."),
    ("Ulm", "Ulm is a city in the German state of Baden-Wuerttemberg, situated on the river Danube. Ulm Minster has the tallest church steeple in the world."),
    ("William Shakespeare", "William Shakespeare was an English playwright and poet, widely regarded as the greatest writer in the English language. He was born in Stratford-upon-Avon in 1564. His plays include Hamlet, Macbeth and Romeo and Juliet."),
    ("Stratford-upon-Avon", "Stratford-upon-Avon is a market town in Warwickshire, England, on the River Avon."),
    ("Hamlet", "Hamlet is a tragedy written by William Shakespeare. It is set in Denmark and follows Prince Hamlet's revenge against his uncle Claudius."),
    ("Leonardo da Vinci", "Leonardo da Vinci was an Italian polymath of the High Renaissance who was active as a painter, engineer and scientist. He painted the Mona Lisa and The Last Supper. He was born in Vinci in 1452."),
    ("Mona Lisa", "The Mona Lisa is a half-length portrait painting by Leonardo da Vinci. It has been on permanent display at the Louvre museum since 1797."),
    ("Louvre", "The Louvre is the world's most-visited art museum, located on the Right Bank of the Seine in Paris."),
    ("Apollo 11", "Apollo 11 was the American spaceflight that first landed humans on the Moon, on 20 July 1969. Commander Neil Armstrong and lunar module pilot Buzz Aldrin landed, while Michael Collins orbited in the command module."),
    ("Neil Armstrong", "Neil Armstrong was an American astronaut and aeronautical engineer who became the first person to walk on the Moon. He was born in Wapakoneta, Ohio, in 1930."),
    ("Python (programming language)", "Python is a high-level, general-purpose programming language. It was created by Guido van Rossum and first released in 1991."),
    ("Guido van Rossum", "Guido van Rossum is a Dutch programmer best known as the creator of the Python programming language."),
    ("Great Wall of China", "The Great Wall of China is a series of fortifications built across the historical northern borders of ancient Chinese states to protect against nomadic groups."),
    ("Beijing", "Beijing is the capital of the People's Republic of China. It hosted the 2008 Summer Olympics and the 2022 Winter Olympics."),
    ("Tokyo", "Tokyo is the capital of Japan and one of the most populous metropolitan areas in the world. It hosted the Summer Olympics in 1964 and 2021."),
    ("Mount Fuji", "Mount Fuji is the highest mountain in Japan, with a summit elevation of 3,776 metres. It is an active volcano about 100 kilometres south-west of Tokyo."),
    ("Nile", "The Nile is a major north-flowing river in northeastern Africa that drains into the Mediterranean Sea. It has historically been considered the longest river in the world."),
    ("Cairo", "Cairo is the capital of Egypt and lies on the Nile near the river's delta."),
    ("Photosynthesis", "Photosynthesis is the process by which plants and other organisms convert light energy into chemical energy. It takes place in chloroplasts and releases oxygen."),
    ("Isaac Newton", "Isaac Newton was an English mathematician and physicist who formulated the laws of motion and universal gravitation. His book Philosophiae Naturalis Principia Mathematica was first published in 1687."),
    ("Charles Darwin", "Charles Darwin was an English naturalist best known for his contributions to evolutionary biology. His book On the Origin of Species was published in 1859."),
    ("HMS Beagle", "HMS Beagle was a Royal Navy ship whose second survey voyage carried the naturalist Charles Darwin around the world from 1831 to 1836."),
    ("Galapagos Islands", "The Galapagos Islands are a volcanic archipelago in the Pacific Ocean that belong to Ecuador. Observations made there by Charles Darwin contributed to his theory of natural selection."),
    ("Ecuador", "Ecuador is a country in northwestern South America. Its capital is Quito."),
    ("Canberra", "Canberra is the capital city of Australia. It was selected as the site of the capital in 1908 as a compromise between Sydney and Melbourne."),
    ("Sydney Opera House", "The Sydney Opera House is a performing arts centre in Sydney, Australia. It was designed by the Danish architect Jorn Utzon and opened in 1973."),
    ("Jorn Utzon", "Jorn Utzon was a Danish architect, best known for designing the Sydney Opera House. He was awarded the Pritzker Prize in 2003."),
    ("Ottawa", "Ottawa is the capital city of Canada. It is located on the Ottawa River in the province of Ontario."),
    ("Toronto", "Toronto is the most populous city in Canada and the capital of the province of Ontario."),
    ("Johann Sebastian Bach", "Johann Sebastian Bach was a German composer of the Baroque period. He was born in Eisenach in 1685."),
    ("Ludwig van Beethoven", "Ludwig van Beethoven was a German composer and pianist. He was born in Bonn in 1770 and wrote nine symphonies."),
    ("Bonn", "Bonn is a city on the banks of the Rhine in the German state of North Rhine-Westphalia. It was the capital of West Germany from 1949 to 1990."),
    ("Wolfgang Amadeus Mozart", "Wolfgang Amadeus Mozart was a prolific composer of the Classical period. He was born in Salzburg in 1756."),
    ("Salzburg", "Salzburg is the fourth-largest city in Austria. It lies on the banks of the Salzach river."),
    ("Gold", "Gold is a chemical element with the symbol Au and atomic number 79."),
    ("Oxygen", "Oxygen is a chemical element with the symbol O and atomic number 8. It is the third most abundant element in the universe by mass."),
    ("Jupiter", "Jupiter is the fifth planet from the Sun and the largest planet in the Solar System."),
    ("Mars", "Mars is the fourth planet from the Sun. It is often called the Red Planet because of the iron oxide on its surface."),
    ("Alexander Graham Bell", "Alexander Graham Bell was a Scottish-born inventor who is credited with patenting the first practical telephone in 1876. He was born in Edinburgh in 1847."),
    ("Edinburgh", "Edinburgh is the capital city of Scotland."),
    ("2018 FIFA World Cup", "The 2018 FIFA World Cup was held in Russia. France won the tournament, defeating Croatia 4-2 in the final."),
    ("Moscow", "Moscow is the capital and largest city of Russia. The final of the 2018 FIFA World Cup was played at the Luzhniki Stadium in Moscow."),
    ("Harry Potter", "Harry Potter is a series of seven fantasy novels written by the British author J. K. Rowling. The first novel, Harry Potter and the Philosopher's Stone, was published in 1997."),
]

# (data_source, question, golden answers, search queries a good policy would issue, wrong answer)
QA = [
    ("nq_sample", "who designed and built the eiffel tower", ["Gustave Eiffel", "Gustave Eiffel's company"], ["Eiffel Tower designed built"], "Napoleon"),
    ("nq_sample", "what is the highest mountain in japan", ["Mount Fuji", "Fuji"], ["highest mountain in Japan"], "Mount Everest"),
    ("nq_sample", "who created the python programming language", ["Guido van Rossum"], ["Python programming language created"], "Dennis Ritchie"),
    ("nq_sample", "when did apollo 11 land on the moon", ["20 July 1969", "July 20, 1969", "1969"], ["Apollo 11 landed Moon"], "1972"),
    ("nq_sample", "what is the chemical symbol for gold", ["Au"], ["gold chemical element symbol"], "Ag"),
    ("nq_sample", "what is the capital of australia", ["Canberra"], ["capital city of Australia"], "Sydney"),
    ("nq_sample", "who wrote harry potter", ["J. K. Rowling", "J.K. Rowling", "Joanne Rowling"], ["Harry Potter novels author"], "Roald Dahl"),
    ("nq_sample", "which planet is known as the red planet", ["Mars"], ["Red Planet"], "Jupiter"),
    ("nq_sample", "who won the 2018 fifa world cup", ["France"], ["2018 FIFA World Cup won"], "Croatia"),
    ("nq_sample", "in what year was on the origin of species published", ["1859"], ["On the Origin of Species published"], "1831"),
    ("hotpotqa_sample", "On which river is the city where Albert Einstein was born?", ["Danube", "the Danube river"], ["Albert Einstein born", "Ulm river"], "Rhine"),
    ("hotpotqa_sample", "What is the capital of the country where Marie Curie was born?", ["Warsaw"], ["Marie Curie born", "Warsaw capital Poland"], "Paris"),
    ("hotpotqa_sample", "Which river flows through the town where William Shakespeare was born?", ["River Avon", "Avon"], ["William Shakespeare born", "Stratford-upon-Avon river"], "Thames"),
    ("hotpotqa_sample", "In which city is the museum that displays the Mona Lisa?", ["Paris"], ["Mona Lisa display museum", "Louvre museum located"], "Florence"),
    ("hotpotqa_sample", "Which prize did the architect of the Sydney Opera House receive in 2003?", ["Pritzker Prize", "Pritzker Architecture Prize"], ["Sydney Opera House architect", "Jorn Utzon prize 2003"], "Nobel Prize"),
    ("hotpotqa_sample", "The city where Beethoven was born was the capital of which country from 1949 to 1990?", ["West Germany"], ["Beethoven born", "Bonn capital 1949 1990"], "Austria"),
    ("hotpotqa_sample", "On which river does the birthplace of Mozart lie?", ["Salzach"], ["Mozart born", "Salzburg river"], "Danube"),
    ("hotpotqa_sample", "In which city was the final of the World Cup won by France in 2018 played?", ["Moscow"], ["2018 FIFA World Cup France final", "2018 World Cup final stadium city"], "Saint Petersburg"),
    ("hotpotqa_sample", "What is the capital of the country that the Galapagos Islands belong to?", ["Quito"], ["Galapagos Islands belong country", "Ecuador capital"], "Lima"),
    ("hotpotqa_sample", "In which city was the inventor of the first practical telephone born?", ["Edinburgh"], ["first practical telephone inventor", "Alexander Graham Bell born"], "London"),
]

N_RESPONSES = 4


def _write_jsonl(path: str, rows) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def math_responses(i: int, answer: str, alt: str, wrong: str) -> list[str]:
    """Four responses with a per-problem pattern of right/wrong and of answer formats."""
    think = "Let me work through this step by step. "
    right_boxed = f"{think}So the final answer is $\\boxed{{{answer}}}$."
    right_alt = f"{think}Equivalently, the answer is \\boxed{{{alt}}}."
    wrong_boxed = f"{think}I get $\\boxed{{{wrong}}}$."
    two_boxed = f"{think}First I thought \\boxed{{{wrong}}}, but checking again gives \\boxed{{{answer}}}."
    no_box = f"{think}After computing, the result is {wrong}."
    truncated = f"{think}The answer is \\boxed{{{answer}"  # cut off: no complete boxed answer
    patterns = [
        [right_boxed, right_alt, two_boxed, right_boxed],  # all right
        [right_alt, wrong_boxed, no_box, right_boxed],  # half
        [wrong_boxed, truncated, no_box, right_alt],  # one of four
        [wrong_boxed, no_box, truncated, wrong_boxed],  # none
    ]
    return patterns[i % len(patterns)]


def search_response(question: str, queries: list[str], answer: str, retriever, topk: int = 3) -> str:
    from emapg_megatron.tasks.retriever import format_passages

    text = ""
    for q in queries:
        text += f"<think> I need to look this up. </think>\n<search> {q} </search>"
        text += f"\n\n<information>{format_passages(retriever.search(q, topk)).strip()}</information>\n\n"
    text += f"<think> I can answer now. </think>\n<answer> {answer} </answer>"
    return text


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    math_rows = [{"data_source": s, "problem": p, "answer": a} for s, p, a, _, _ in MATH]
    _write_jsonl(os.path.join(HERE, "math.jsonl"), math_rows)
    pq.write_table(pa.Table.from_pylist(math_rows), os.path.join(HERE, "math.parquet"))
    _write_jsonl(os.path.join(HERE, "math_responses.jsonl"), [
        {"index": i, "responses": math_responses(i, a, alt, w)} for i, (_, _, a, alt, w) in enumerate(MATH)
    ])

    corpus = [{"id": str(i), "contents": f'"{t}"\n{x}'} for i, (t, x) in enumerate(CORPUS)]
    _write_jsonl(os.path.join(HERE, "corpus.jsonl"), corpus)
    qa = [{"data_source": s, "question": q, "golden_answers": g} for s, q, g, _, _ in QA]
    _write_jsonl(os.path.join(HERE, "qa.jsonl"), qa)

    from emapg_megatron.tasks.retriever import BM25Retriever

    retr = BM25Retriever(os.path.join(HERE, "corpus.jsonl"))
    out = []
    for i, (_, q, golds, queries, wrong) in enumerate(QA):
        good = search_response(q, queries, golds[0], retr)
        no_search_wrong = f"<think> I think I know this. </think>\n<answer> {wrong} </answer>"
        malformed = f"<think> Let me search. </think>\n<search> {queries[0]}"  # unclosed, no answer
        partial = search_response(q, queries[:1], wrong if len(queries) > 1 else golds[0], retr)
        patterns = [
            [good, good, partial, good],
            [good, no_search_wrong, malformed, partial],
            [no_search_wrong, malformed, good, no_search_wrong],
        ]
        out.append({"index": i, "responses": patterns[i % len(patterns)]})
    _write_jsonl(os.path.join(HERE, "search_responses.jsonl"), out)
    print(f"wrote {len(math_rows)} math problems, {len(corpus)} passages, {len(qa)} questions to {HERE}")


if __name__ == "__main__":
    main()
