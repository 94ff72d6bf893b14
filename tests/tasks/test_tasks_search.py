"""Search-agent task: environment protocol, loss masks, malformed tags, reward, retriever service."""
import json
import os
import urllib.error
import urllib.request

import pytest

from emapg_megatron.tasks.base import (
    ROLE_MODEL,
    ROLE_OBSERVATION,
    Segment,
    build_token_ids_and_mask,
)
from emapg_megatron.tasks.search import (
    INVALID_ACTION_MESSAGE,
    SearchConfig,
    SearchEnv,
    SearchTask,
    extract_final_answer,
    f1_score,
    normalize_answer,
    parse_action,
    reward,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "data", "samples", "corpus.jsonl")
QA = os.path.join(ROOT, "data", "samples", "qa.jsonl")


class CharTokenizer:
    """The smallest tokenizer the interface accepts: one id per character."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _hf_tokenizer():
    """A real byte-level BPE HF tokenizer, trained in memory (adds BOS by default)."""
    pytest.importorskip("transformers")
    from tiny_hf import byte_level_bpe
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    with open(CORPUS) as f:
        text = [json.loads(line)["contents"] for line in f]
    text += ["<search> query </search>\n\n<information>Doc 1(Title: x) y</information>\n\n<answer> a </answer>"] * 20
    tok = byte_level_bpe(text, 500, ["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return hf


@pytest.fixture(scope="module")
def hf_tok():
    return _hf_tokenizer()


# ----------------------------------------------------------------------------------------------
# reward


@pytest.mark.parametrize(
    "response, golds, em",
    [
        ("<answer> Gustave Eiffel </answer>", ["Gustave Eiffel"], 1.0),
        ("<answer>gustave eiffel.</answer>", ["Gustave Eiffel"], 1.0),
        ("<answer> The Danube </answer>", ["Danube"], 1.0),
        ("<answer>J.K. Rowling</answer>", ["J. K. Rowling"], 0.0),  # "jk" vs "j k"
        ("<answer>J.K. Rowling</answer>", ["J. K. Rowling", "J.K. Rowling"], 1.0),
        ("<answer> Paris </answer> then <answer> Lyon </answer>", ["Paris"], 0.0),  # last counts
        ("<answer> Lyon </answer> then <answer> Paris </answer>", ["Paris"], 1.0),
        ("Paris", ["Paris"], 0.0),  # no answer tag
        ("<answer> Paris", ["Paris"], 0.0),  # unclosed
        ("<answer></answer>", ["Paris"], 0.0),
        ("<answer>\nWest\nGermany\n</answer>", ["West Germany"], 1.0),
        ("<answer>Au</answer>", "Au", 1.0),  # a bare string is accepted too
    ],
)
def test_reward_exact_match(response, golds, em):
    assert reward(response, golds) == em


def test_reward_f1_and_normalisation():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an Apple a day") == "apple day"
    assert f1_score("river avon", ["Avon"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert reward("<answer>the river Avon</answer>", ["Avon"], metric="f1") == pytest.approx(2 / 3)
    assert reward("<answer>Avon</answer>", ["River Avon", "Avon"], metric="f1") == 1.0
    assert reward("no answer", ["Avon"], metric="f1") == 0.0
    assert reward(None, ["x"]) == 0.0
    assert extract_final_answer("<answer> a </answer><answer> b </answer>") == "b"
    with pytest.raises(ValueError):
        reward("<answer>x</answer>", ["x"], metric="bleu")


# ----------------------------------------------------------------------------------------------
# action parsing and malformed tags


@pytest.mark.parametrize(
    "text, kind, content, reason",
    [
        ("<think>hm</think>\n<search> capital of France </search>", "search", "capital of France", ""),
        ("<answer> Paris </answer>", "answer", "Paris", ""),
        ("<search> unclosed query", "invalid", "", "unclosed tag"),
        ("just thinking, no tags", "invalid", "", "no action tag"),
        ("query </search>", "invalid", "", "</search> without <search>"),
        ("<search> a <search> b </search>", "invalid", "", "nested or unclosed tags"),
        ("<search> a <answer> b </answer>", "invalid", "", "nested or unclosed tags"),
        ("<search> q <information>x</information> </search>", "invalid", "", "nested tags"),
        ("<search>   </search>", "invalid", "", "empty query"),
        ("<search> q1 </search> <answer> A </answer>", "search", "q1", ""),  # first closing wins
        ("<answer> A </answer> <search> q1 </search>", "answer", "A", ""),
        ("<answer></answer>", "answer", "", ""),
    ],
)
def test_parse_action(text, kind, content, reason):
    a = parse_action(text)
    assert a.kind == kind
    assert a.content == content
    assert a.reason == reason


def test_both_tags_cut_after_first_action(retriever):
    env = SearchEnv(retriever, SearchConfig(max_turns=3))
    res = env.step("<search> Mount Fuji </search> and <answer> Fuji </answer>")
    assert not res.done and res.info["action"] == "search"
    assert res.model_text == "<search> Mount Fuji </search>"
    assert env.segments[0].text == res.model_text


@pytest.mark.parametrize(
    "text",
    ["<search> unclosed", "<search></search>", "<search> a <search> b </search>", "nothing", "</answer>"],
)
def test_malformed_turn_gets_invalid_observation(retriever, text):
    env = SearchEnv(retriever, SearchConfig(max_turns=3))
    res = env.step(text)
    assert not res.done
    assert res.observation == INVALID_ACTION_MESSAGE
    assert res.info["action"] == "invalid" and res.info["invalid_reason"]
    assert env.invalid_turns == 1
    # the episode goes on
    res = env.step("<answer> Fuji </answer>")
    assert res.done and env.answer == "Fuji"


# ----------------------------------------------------------------------------------------------
# the environment with a scripted policy


def test_scripted_policy_gets_right_passages(retriever):
    task = SearchTask(retriever=retriever)
    row = {"question": "On which river is the city where Albert Einstein was born?", "golden_answers": ["Danube"]}
    env = task.make_env(row)
    r1 = env.step("<think> Where was Einstein born? </think>\n<search> Albert Einstein born </search>")
    assert not r1.done
    assert r1.observation.startswith("\n\n<information>") and r1.observation.endswith("</information>\n\n")
    assert "Doc 1(Title: Albert Einstein)" in r1.observation and "born in Ulm" in r1.observation
    assert r1.info["passage_ids"][0] == "7"
    r2 = env.step("<think> Ulm. Which river? </think>\n<search> Ulm river </search>")
    assert "Doc 1(Title: Ulm)" in r2.observation and "Danube" in r2.observation
    r3 = env.step("<think> The Danube. </think>\n<answer> Danube </answer>")
    assert r3.done and r3.observation is None and r3.info["reason"] == "answer"
    assert env.queries == ["Albert Einstein born", "Ulm river"]
    assert [s.role for s in env.segments] == [ROLE_MODEL, ROLE_OBSERVATION] * 2 + [ROLE_MODEL]
    assert task.reward(env.response_text, row) == 1.0
    assert task.stop_strings == ["</search>", "</answer>"]


def test_turn_limit_is_enforced(retriever):
    env = SearchEnv(retriever, SearchConfig(max_turns=3))
    results = [env.step(f"<search> Mount Fuji {i} </search>") for i in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].observation is None and results[-1].info["reason"] == "max_turns"
    assert sum(s.role == ROLE_OBSERVATION for s in env.segments) == 2  # max_turns - 1 searches
    with pytest.raises(RuntimeError):
        env.step("<answer> x </answer>")


def test_single_turn_limit(retriever):
    env = SearchEnv(retriever, SearchConfig(max_turns=1))
    res = env.step("<search> Fuji </search>")
    assert res.done and res.observation is None


def _check_mask(segments, tok):
    ids, mask = build_token_ids_and_mask(segments, tok)
    assert len(ids) == len(mask)
    pos = 0
    for seg in segments:
        seg_ids = seg.token_ids if seg.token_ids is not None else tok.encode(seg.text)
        n = len(seg_ids)
        assert ids[pos : pos + n] == list(seg_ids)
        assert mask[pos : pos + n] == [1 if seg.role == ROLE_MODEL else 0] * n
        pos += n
    assert pos == len(ids)
    return ids, mask


def test_mask_covers_exactly_the_observation_tokens_char_tokenizer(retriever):
    tok = CharTokenizer()
    env = SearchEnv(retriever, SearchConfig(max_turns=4), tokenizer=tok)
    env.step("<search> Red Planet </search>")
    env.step("<answer> Mars </answer>")
    ids, mask = _check_mask(env.segments, tok)
    obs = env.segments[1].text
    model = env.segments[0].text + env.segments[2].text
    assert tok.decode([i for i, m in zip(ids, mask) if m == 0]) == obs
    assert tok.decode([i for i, m in zip(ids, mask) if m == 1]) == model
    assert mask.count(0) == len(obs)


def test_mask_with_hf_tokenizer_and_sampled_ids(retriever, hf_tok):
    """The trainer's incremental sequence (sampled ids + observation ids) equals the built one."""
    env = SearchEnv(retriever, SearchConfig(max_turns=4), tokenizer=hf_tok)
    trainer_ids, trainer_mask = [], []
    turns = [
        "<think> I should search. </think>\n<search> Galapagos Islands belong country </search>",
        "<think> Ecuador. </think>\n<search> Ecuador capital </search>",
        "<answer> Quito </answer>",
    ]
    for text in turns:
        sampled = hf_tok.encode(text, add_special_tokens=False)
        res = env.step(text, token_ids=sampled)
        trainer_ids += sampled
        trainer_mask += [1] * len(sampled)
        if res.done:
            break
        obs_ids = res.info["observation_ids"]
        trainer_ids += obs_ids
        trainer_mask += [0] * len(obs_ids)
    ids, mask = _check_mask(env.segments, hf_tok)
    assert (ids, mask) == (trainer_ids, trainer_mask)
    assert hf_tok.bos_token_id not in ids  # no special tokens leak into segments
    masked_text = hf_tok.decode([i for i, m in zip(ids, mask) if m == 0])
    assert masked_text == "".join(s.text for s in env.segments if s.role == ROLE_OBSERVATION)
    assert "Quito" in masked_text


def test_cut_lands_on_sampled_token_boundary(retriever, hf_tok):
    env = SearchEnv(retriever, SearchConfig(max_turns=4), tokenizer=hf_tok)
    text = "<search> Mozart born </search> trailing words the sampler did not stop on"
    sampled = hf_tok.encode(text, add_special_tokens=False)
    res = env.step(text, token_ids=sampled)
    seg = env.segments[0]
    assert seg.token_ids == sampled[: len(seg.token_ids)] and len(seg.token_ids) < len(sampled)
    assert seg.text == hf_tok.decode(seg.token_ids)
    assert seg.text.startswith("<search> Mozart born </search>")
    assert "trailing" not in seg.text
    assert res.info["query"] == "Mozart born"


def test_per_turn_token_budget(retriever):
    tok = CharTokenizer()
    env = SearchEnv(retriever, SearchConfig(max_turns=3, max_turn_tokens=20), tokenizer=tok)
    res = env.step("<think> a very long chain of thought </think> <search> q </search>")
    assert len(env.segments[0].token_ids) == 20
    assert res.info["action"] == "invalid"  # the closing tag fell past the budget
    assert env.max_turn_tokens == 20


def test_observation_token_budget(retriever, hf_tok):
    env = SearchEnv(retriever, SearchConfig(max_turns=3, max_obs_tokens=40, topk=3), tokenizer=hf_tok)
    res = env.step("<search> capital city </search>")
    assert len(hf_tok.encode(res.observation, add_special_tokens=False)) <= 40
    assert res.observation.startswith("\n\n<information>")
    assert res.observation.endswith("</information>\n\n")


def test_retriever_failure_does_not_end_the_run():
    class Broken:
        def search(self, q, k=3):
            raise ConnectionError("down")

    env = SearchEnv(Broken(), SearchConfig(max_turns=3))
    res = env.step("<search> anything </search>")
    assert not res.done and "No results found." in res.observation


def test_no_hits_for_stopword_query(retriever):
    assert retriever.search("the of and", 3) == []
    env = SearchEnv(retriever, SearchConfig(max_turns=3))
    assert "No results found." in env.step("<search> the of and </search>").observation


# ----------------------------------------------------------------------------------------------
# task: loading and prompts


def test_search_task_load_and_prompts(hf_tok):
    task = SearchTask(retriever=CORPUS)
    ds = task.load(QA)
    assert len(ds) == 20
    assert ds[0]["golden_answers"] == ["Gustave Eiffel", "Gustave Eiffel's company"]
    assert ds[0]["data_source"] == "nq_sample"
    plain = task.prompts(ds.select(range(2)))
    assert plain[0].startswith("Answer the given question.")
    assert plain[0].endswith("Question: who designed and built the eiffel tower?\n")
    chat = task.prompts([ds[0]], hf_tok)[0]
    assert chat.startswith("<|user|>Answer the given question.") and chat.endswith("<|assistant|>")
    never = SearchTask(retriever=CORPUS, chat_template="never").prompt(ds[0], hf_tok)
    assert never == plain[0]
    env = task.make_env(ds[0])
    assert "Eiffel" in env.step("<search> Eiffel Tower designed built </search>").observation


# ----------------------------------------------------------------------------------------------
# HTTP retriever service


def test_http_service_round_trip(retriever):
    from emapg_megatron.tasks.retriever import RetrieverClient, RetrieverServer

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for loopback
    with RetrieverServer(retriever, host="127.0.0.1", port=0) as srv:
        assert srv.port > 0 and srv.url.startswith("http://127.0.0.1:")
        client = RetrieverClient(srv.url, timeout=5)
        queries = ["highest mountain in Japan", "Red Planet", "the of"]
        remote = client.batch_search(queries, k=2)
        local = retriever.batch_search(queries, k=2)
        assert [[h["id"] for h in r] for r in remote] == [[h["id"] for h in r] for r in local]
        assert remote[0][0]["title"] == "Mount Fuji" and remote[2] == []
        assert remote[0][0]["score"] == pytest.approx(local[0][0]["score"])
        with opener.open(srv.url + "/health", timeout=5) as r:
            assert json.loads(r.read())["passages"] == 50
        # Search-R1 wire format
        req = urllib.request.Request(srv.url + "/retrieve", method="POST",
                                     data=json.dumps({"queries": ["Mars"], "topk": 1, "return_scores": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with opener.open(req, timeout=5) as r:
            doc = json.loads(r.read())["result"][0][0]
        assert doc["document"]["contents"].startswith('"Mars"\n') and doc["score"] > 0
        # a bad request is a client error, not a retry loop
        bad = RetrieverClient(srv.url, timeout=5)
        bad_body = urllib.request.Request(srv.url + "/retrieve", method="POST", data=b'{"queries": 5}')
        with pytest.raises(urllib.error.HTTPError) as e:
            opener.open(bad_body, timeout=5)
        assert e.value.code == 400
        assert bad.search("Mars", 1)[0]["title"] == "Mars"
        # an environment can use the client directly
        env = SearchEnv(client, SearchConfig(max_turns=2))
        assert "Doc 1(Title: Mars)" in env.step("<search> Red Planet </search>").observation


def test_http_service_is_loopback_only(retriever):
    from emapg_megatron.tasks.retriever import RetrieverClient, RetrieverServer

    with pytest.raises(ValueError):
        RetrieverServer(retriever, host="0.0.0.0", port=0)
    srv = RetrieverServer(retriever, port=0)
    port = srv.port
    srv.close()
    with pytest.raises(ConnectionError):
        RetrieverClient(f"http://127.0.0.1:{port}", timeout=1, retries=0).search("x")


def test_build_token_ids_and_mask_basic():
    tok = CharTokenizer()
    segs = [Segment("ab", "prompt"), Segment("cd", "model"), Segment("ef", "observation"),
            Segment("g", "model", token_ids=[1, 2, 3])]
    ids, mask = build_token_ids_and_mask(segs, tok)
    assert ids == [97, 98, 99, 100, 101, 102, 1, 2, 3]
    assert mask == [0, 0, 1, 1, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError):
        Segment("x", "assistant")


@pytest.mark.timeout(120)  # a hang guard, not a timing assertion: quadratic parsing takes hours
def test_degenerate_responses_are_parsed():
    for text in ["<answer>" * 50000, "<search>" * 50000 + "</answer>", "<search> q" * 30000]:
        assert reward(text, ["q"]) == 0.0
        assert parse_action(text).kind == "invalid"


def test_missing_optional_dependencies_name_the_extra(monkeypatch):
    import importlib.util

    from emapg_megatron.tasks import retriever as rt

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("bm25s", "faiss") else real(name, *a))
    with pytest.raises(ImportError, match=r"emapg-megatron\[search\]"):
        rt.BM25Retriever(CORPUS)
    with pytest.raises(ImportError, match="faiss"):
        rt.DenseRetriever(CORPUS, "index.faiss")
