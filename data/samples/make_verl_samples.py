"""Writes verl_gsm8k.parquet and verl_deepscaler.parquet: tiny files with the schema of the math
data verl's preprocessing scripts (and the paper's reference code) produce, made here from a few
hand-written problems. Run from anywhere: ``python data/samples/make_verl_samples.py``."""

import os

import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
GSM8K_SUFFIX = ' Let\'s think step by step and output the final answer after "####".'
DEEPSCALER_SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."

GSM8K = [
    ("Tom has 3 apples and buys 5 more. How many apples does he have?", "8"),
    ("A box holds 12 eggs. How many eggs are in 4 boxes?", "48"),
    ("Sara reads 15 pages a day. How many pages does she read in a week?", "105"),
    ("A shirt costs $20 and is 25% off. What does it cost now?", "15"),
    ("There are 30 students and 6 groups of equal size. How many students per group?", "5"),
    ("Ann is 7 years older than Ben, who is 9. How old is Ann?", "16"),
]
DEEPSCALER = [
    ("What is the remainder when $2^{10}$ is divided by 7?", "2"),
    ("Find the sum of the roots of $x^2 - 5x + 6 = 0$.", "5"),
    ("How many positive divisors does 36 have?", "9"),
    ("Compute $\\binom{6}{2}$.", "15"),
    ("If $3x + 4 = 19$, what is $x$?", "5"),
    ("What is the area of a right triangle with legs 6 and 8?", "24"),
]


def rows(problems, source, suffix, answer_key):
    for i, (question, answer) in enumerate(problems):
        yield {"data_source": source,
               "prompt": [{"role": "user", "content": question + suffix}],
               "ability": "math",
               "reward_model": {"style": "rule", "ground_truth": answer},
               "extra_info": {"split": "train", "index": i, answer_key: answer, "question": question}}


def write(name, records):
    pq.write_table(pa.Table.from_pylist(list(records)), os.path.join(HERE, name))


if __name__ == "__main__":
    write("verl_gsm8k.parquet", rows(GSM8K, "openai/gsm8k", GSM8K_SUFFIX, "answer"))
    write("verl_deepscaler.parquet", rows(DEEPSCALER, "agentica-org/DeepScaleR-Preview-Dataset",
                                          DEEPSCALER_SUFFIX, "answer"))
