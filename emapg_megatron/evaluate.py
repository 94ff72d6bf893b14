"""Evaluate a task: Pass@1 (averaged over N samples) and unbiased Pass@k, per data source.

    python -m emapg_megatron.evaluate --task math --data-path data/samples/math.jsonl \\
        --responses data/samples/math_responses.jsonl --num-samples-per-prompt 4 --out runs/eval_math

The flags are generated from configs (``emapg_megatron.configurable``), the task's own among
them (:class:`~emapg_megatron.tasks.config.SearchConfig`, the columns, ``--chat-template``), so a
setting both ``emapg-evaluate`` and ``emapg-train`` have is spelled the same in both. The old
spellings ``--data``, ``--n-samples`` and ``--field NAME=COLUMN`` still parse, with a deprecation
line on stderr.

Two sources of responses:

* ``--responses FILE``: precomputed responses, jsonl. Each line is
  ``{"index": <row index in the data file>, "responses": ["...", ...]}`` (or ``"response": "..."``
  with one line per sample; lines with the same index accumulate). ``index`` is the 0-based
  row number in the data file (the ``_index`` column of the loaded rows). With several
  ``--data-path`` files add ``"file": "<basename>"``. Without any ``index`` the lines are matched to
  the loaded rows in order, and the counts must agree.
* ``--load CKPT``: generate with a model through ``emapg_megatron.rollout`` (imported lazily;
  it must provide ``load_generation_backend(ckpt, **generation_kwargs)`` returning a
  :class:`GenerationBackend`). Generated responses are written to ``OUT/responses.jsonl`` as
  they are generated (``_GEN_CHUNK`` samples at a time, with a progress line on stderr), so a
  failed run keeps the rows it finished.

Budgets with ``--load``: ``--max-new-tokens`` is the length of a single-turn response; a
multi-turn task (search) gives each model turn ``--max-turn-tokens`` (default: the task's own;
0: ``--max-new-tokens``), like the trainer.

Every user-facing failure (unreadable data or responses, a checkpoint that does not load, a
missing retriever, a generation that fails) is one ``error:`` line and exit code 2; ``-v`` adds
the underlying traceback.

Outputs in ``--out``: ``results.json``, ``results.md`` (one table, a row per data source plus
the overall row), ``passk.png`` (Pass@k curves) and ``scores.jsonl`` (per-row correctness).

Scoring uses correctness only (no format bonus): math-verify equivalence for ``math``, exact
match of the final ``<answer>`` for ``search``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import sys
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol, Sequence

from . import configurable
from .configurable import ANY_NUMBER, above, at_least, between, option
from .errors import ConfigError
from .tasks import get_task
from .tasks.config import DataColumns, MathConfig, PromptConfig, SearchConfig
from .tasks.math_verifier import DEFAULT_TIMEOUT
from .tasks.passk import default_ks, mean_pass_at_k

logger = logging.getLogger("emapg_megatron.evaluate")

#: samples generated per backend call (and written, and counted by the progress line, at once)
_GEN_CHUNK = 256
#: responses scored at a time (the progress line counts them)
_SCORE_CHUNK = 4096
#: --max-new-tokens when not given
DEFAULT_MAX_NEW_TOKENS = 1024

__all__ = [
    "GenerationBackend",
    "generate_responses",
    "read_responses",
    "score",
    "summarize",
    "write_report",
    "EvaluateConfig",
    "build_parser",
    "parse_args",
    "main",
]


class GenerationBackend(Protocol):
    """Anything that samples ``n`` continuations for each prompt string.

    ``stop`` (strings, kept in the output) and ``max_new_tokens`` are passed for multi-turn
    tasks; a backend may ignore keyword arguments it does not know.
    """

    def __call__(self, prompts: list[str], n: int, **kwargs: Any) -> list[list[str]]: ...


class EvalError(Exception):
    """A user-facing error: reported as one line, exit code 2."""


# ----------------------------------------------------------------------------------------------
# responses


def read_responses(path: str, rows: Sequence[Mapping[str, Any]], n_samples: int) -> list[list[str]]:
    """Responses per loaded row (first ``n_samples`` of each), matched by index (see module doc)."""
    from .tasks.data import DataFileError, open_regular  # datasets: not on --help's path

    if not os.path.exists(path):
        raise EvalError(f"responses file not found: {path}")
    try:
        stream = open_regular(path)  # not a folder, a named pipe or a device
    except DataFileError as e:
        raise EvalError(f"--responses {e}") from None
    records = []
    with stream as f:
        for ln, raw in enumerate(f):
            rec = _response_record(path, ln, raw)
            if rec is None:
                continue
            if "responses" in rec:
                resps = rec["responses"]
                if isinstance(resps, str):
                    resps = [resps]
            elif "response" in rec:
                resps = [rec["response"]]
            else:
                raise EvalError(f"{path}: line {ln} has neither 'responses' nor 'response'")
            if not isinstance(resps, list) or not all(isinstance(r, str) for r in resps):
                raise EvalError(f"{path}: line {ln}: responses must be strings")
            if "index" in rec and (isinstance(rec["index"], bool) or not isinstance(rec["index"], int)):
                raise EvalError(f"{path}: line {ln}: 'index' must be an integer, got {rec['index']!r:.40}")
            if not isinstance(rec.get("file", ""), str):
                raise EvalError(f"{path}: line {ln}: 'file' must be a string")
            records.append((ln, rec, resps))

    multi_file = len({r.get("_file") for r in rows}) > 1
    if records and all("index" not in rec for _, rec, _ in records):
        if len(records) != len(rows):
            raise EvalError(
                f"{path}: {len(records)} lines without 'index' for {len(rows)} rows; add an 'index' field"
            )
        by_row = [list(resps) for _, _, resps in records]
    else:
        key_of = {}
        for pos, r in enumerate(rows):
            key_of[(r.get("_file") if multi_file else None, int(r["_index"]))] = pos
        by_row = [[] for _ in rows]
        unknown = []
        for ln, rec, resps in records:
            if "index" not in rec:
                raise EvalError(f"{path}: line {ln} has no 'index' (other lines do)")
            key = (rec.get("file") if multi_file else None, int(rec["index"]))
            pos = key_of.get(key)
            if pos is None:
                unknown.append(rec["index"])
                continue
            by_row[pos].extend(resps)
        if unknown:
            logger.warning("%d response line(s) refer to rows not loaded (skipped or absent): index %s",
                           len(unknown), unknown[:20])
    short = [int(r["_index"]) for r, resps in zip(rows, by_row) if len(resps) < n_samples]
    if short:
        raise EvalError(
            f"{len(short)} row(s) have fewer than --num-samples-per-prompt {n_samples} responses in {path}: index "
            f"{short[:20]}{' ...' if len(short) > 20 else ''}"
        )
    return [resps[:n_samples] for resps in by_row]


def _response_record(path: str, ln: int, raw: bytes) -> Optional[dict]:
    """One line of a responses file as a JSON object (None for a blank line)."""
    from .tasks.data import MAX_JSON_DEPTH, json_too_deep

    try:
        line = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise EvalError(f"{path}: line {ln} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not line:
        return None
    if json_too_deep(line):
        raise EvalError(f"{path}: line {ln} is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise EvalError(f"{path}: line {ln} is not valid JSON ({e.msg})") from None
    if not isinstance(rec, dict):
        raise EvalError(f"{path}: line {ln} is not a JSON object")
    return rec


def generate_responses(task, rows: Sequence[Mapping[str, Any]], backend: GenerationBackend, n: int,
                       tokenizer: Any = None) -> list[list[str]]:
    """Sample ``n`` responses per row; multi-turn tasks run their environment between turns."""
    prompts = task.prompts(rows, tokenizer)
    if not task.multi_turn:
        out = backend(prompts, n, stop=task.stop_strings or None)
        if len(out) != len(prompts) or any(len(o) != n for o in out):
            raise EvalError("generation backend returned the wrong number of responses")
        return [list(o) for o in out]
    episodes = []  # (row position, prompt, env)
    for pos, (row, prompt) in enumerate(zip(rows, prompts)):
        for _ in range(n):
            episodes.append((pos, prompt, task.make_env(row, tokenizer)))
    active = list(range(len(episodes)))
    while active:
        texts = [episodes[i][1] + episodes[i][2].response_text for i in active]
        env0 = episodes[active[0]][2]
        outs = backend(texts, 1, stop=task.stop_strings or None,
                       max_new_tokens=env0.max_turn_tokens or None)  # None: the backend's own
        still = []
        for i, o in zip(active, outs):
            res = episodes[i][2].step(o[0] if o else "")
            if not res.done:
                still.append(i)
        active = still
    out: list[list[str]] = [[] for _ in rows]
    for pos, _, env in episodes:
        out[pos].append(env.response_text)
    return out


def load_backend(ckpt: str, **gen_kwargs: Any) -> GenerationBackend:
    try:
        rollout = importlib.import_module("emapg_megatron.rollout")
        factory = getattr(rollout, "load_generation_backend")
    except (ImportError, AttributeError) as e:
        raise EvalError(
            "--load needs emapg_megatron.rollout.load_generation_backend, which is not available yet "
            f"({type(e).__name__}: {e}); use --responses FILE"
        ) from None
    try:
        return factory(ckpt, **gen_kwargs)
    except ValueError as e:  # ConfigError included: a user error, one line
        raise EvalError(str(e)) from e
    except Exception as e:  # noqa: BLE001 - a checkpoint that does not load (-v: the traceback)
        raise EvalError(f"--load {ckpt}: cannot load the model ({_reason(e)})") from e


def _reason(e: BaseException, limit: int = 300) -> str:
    """``e`` on one line; named by its type unless it is a ValueError (a user-facing message)."""
    text = " ".join(str(e).split())
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return text if isinstance(e, ValueError) else f"{type(e).__name__}: {text}"


class _Progress:
    """``generated D/T responses (P%), R/s, ~Ss left`` on stderr (``verb``: what is done to them):
    redrawn in place on a terminal, else a line at most every ``every`` seconds, and always at the
    end."""

    def __init__(self, total: int, stream=None, every: float = 30.0, verb: str = "generated"):
        self.total, self.stream, self.verb = total, stream or sys.stderr, verb
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = 0.5 if self.tty else every
        self.start = self.last = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        end = done >= self.total
        if not end and now - self.last < self.every:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-6)
        left = f", ~{(self.total - done) / rate:.0f}s left" if rate > 0 and not end else ""
        line = (f"{self.verb} {done}/{self.total} responses ({100.0 * done / max(self.total, 1):.0f}%), "
                f"{rate:.2f}/s{left}")
        self.stream.write(("\r" + line + ("\n" if end else "")) if self.tty else line + "\n")
        self.stream.flush()


def _prepare_load(task, cfg: EvaluateConfig, rows) -> None:
    """What a --load run needs besides the model, checked before loading it."""
    if not task.multi_turn:
        return
    name, search, max_new = cfg.task.name, cfg.task.search, cfg.sampling.max_new_tokens
    if name == "search" and not search.retriever:
        raise EvalError("--task search --load needs --retriever (a corpus jsonl or the http:// URL of a "
                        "retriever service)")
    search.check_retriever()
    try:
        task.make_env(rows[0])  # builds the retriever (loads and indexes a corpus)
    except (ImportError, OSError, ValueError) as e:
        what = f"--retriever {search.retriever}" if search.retriever else f"--task {name}"
        raise EvalError(f"{what}: {_reason(e)}") from e
    turn = getattr(task, "max_turn_tokens", None)
    if max_new is not None and turn and max_new != turn:
        logger.warning("--max-new-tokens %d is not used by --task %s: each model turn gets "
                       "--max-turn-tokens %d (0: --max-new-tokens)", max_new, name, turn)


def _generate_to_file(task, rows, backend, n: int, out_dir: str) -> list[list[str]]:
    """Generate ``n`` responses per row, appending each chunk of rows to OUT/responses.jsonl as
    it is done (a failure keeps the finished rows) and showing progress on stderr."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "responses.jsonl")
    tokenizer = getattr(backend, "tokenizer", None)
    step = max(1, _GEN_CHUNK // n)
    progress = _Progress(len(rows) * n)
    responses: list[list[str]] = []
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, len(rows), step):
            part = rows[start:start + step]
            try:
                got = generate_responses(task, part, backend, n, tokenizer=tokenizer)
            except EvalError:
                raise
            except Exception as e:  # noqa: BLE001 - one line (-v: the traceback)
                kept = f"; the {start} rows done are in {path}" if start else ""
                raise EvalError(f"generation failed ({_reason(e)}){kept}") from e
            for row, resps in zip(part, got):
                f.write(json.dumps({"index": int(row["_index"]), "file": row.get("_file"),
                                    "responses": resps}) + "\n")
            f.flush()
            responses.extend(got)
            progress.update(len(responses) * n)
    return responses


# ----------------------------------------------------------------------------------------------
# scoring and reporting


def score(task, rows: Sequence[Mapping[str, Any]], responses: Sequence[Sequence[str]],
          progress: bool = False) -> list[list[bool]]:
    """Each response's correctness, per row; ``progress``: a progress line on stderr while scoring
    (``_SCORE_CHUNK`` responses at a time)."""
    flat_resp, flat_rows, shape = [], [], []
    for row, resps in zip(rows, responses):
        shape.append(len(resps))
        flat_resp.extend(resps)
        flat_rows.extend([row] * len(resps))
    bar = _Progress(len(flat_resp), verb="scored") if progress else None
    flat = []
    for start in range(0, len(flat_resp), _SCORE_CHUNK):
        flat.extend(task.correct_many(flat_resp[start:start + _SCORE_CHUNK], flat_rows[start:start + _SCORE_CHUNK]))
        if bar is not None:
            bar.update(len(flat))
    out, i = [], 0
    for n in shape:
        out.append([bool(x) for x in flat[i : i + n]])
        i += n
    return out


def summarize(rows: Sequence[Mapping[str, Any]], correct: Sequence[Sequence[bool]], ks: Sequence[int]) -> dict:
    groups: "OrderedDict[str, list[int]]" = OrderedDict()
    for pos, row in enumerate(rows):
        groups.setdefault(str(row.get("data_source") or "default"), []).append(pos)

    def block(positions: list[int]) -> dict:
        ns = [len(correct[p]) for p in positions]
        cs = [sum(correct[p]) for p in positions]
        res = {
            "n_problems": len(positions),
            "n_samples": ns[0] if ns and len(set(ns)) == 1 else ns,
            "pass@1": mean_pass_at_k(ns, cs, 1),
        }
        res["pass@k"] = {str(k): mean_pass_at_k(ns, cs, k) for k in ks}
        return res

    by_source = OrderedDict((src, block(pos)) for src, pos in groups.items())
    overall = block(list(range(len(rows))))
    macro = {
        "pass@1": sum(b["pass@1"] for b in by_source.values()) / max(len(by_source), 1),
        "pass@k": {str(k): sum(b["pass@k"][str(k)] for b in by_source.values()) / max(len(by_source), 1)
                   for k in ks},
    }
    return {"ks": list(ks), "by_source": by_source, "overall": overall, "macro_avg": macro}


def _markdown(summary: dict, title: str) -> str:
    ks = [k for k in summary["ks"] if k != 1]  # pass@1 has its own column
    head = ["data_source", "problems", "pass@1 (mean over samples)"] + [f"pass@{k}" for k in ks]
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(name: str, b: dict, n: Any) -> str:
        vals = [name, str(n), f"{b['pass@1']:.4f}"] + [f"{b['pass@k'][str(k)]:.4f}" for k in ks]
        return "| " + " | ".join(vals) + " |"

    for src, b in summary["by_source"].items():
        lines.append(row(src, b, b["n_problems"]))
    lines.append(row("**overall**", summary["overall"], summary["overall"]["n_problems"]))
    if len(summary["by_source"]) > 1:
        lines.append(row("macro avg", summary["macro_avg"], len(summary["by_source"])))
    lines.append("")
    lines.append("Pass@k: unbiased estimator 1 - C(n-c,k)/C(n,k), averaged over problems.")
    return "\n".join(lines) + "\n"


def _plot(summary: dict, path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ks = summary["ks"]
    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    curves = list(summary["by_source"].items())
    if len(curves) > 1:
        curves.append(("overall", summary["overall"]))
    for name, b in curves:
        ax.plot(ks, [b["pass@k"][str(k)] for k in ks], marker="o", label=name,
                linewidth=2.5 if name == "overall" else 1.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def write_report(out_dir: str, summary: dict, meta: dict, rows, correct) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    title = f"{meta.get('task', '')} evaluation (n={meta.get('n_samples')})"
    result = dict(meta, **summary)
    paths = {
        "json": os.path.join(out_dir, "results.json"),
        "markdown": os.path.join(out_dir, "results.md"),
        "png": os.path.join(out_dir, "passk.png"),
        "scores": os.path.join(out_dir, "scores.jsonl"),
    }
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=2)
    with open(paths["markdown"], "w") as f:
        f.write(_markdown(summary, title))
    with open(paths["scores"], "w") as f:
        for row, c in zip(rows, correct):
            f.write(json.dumps({"index": int(row["_index"]), "file": row.get("_file"),
                                "data_source": row.get("data_source"), "correct": [int(x) for x in c]}) + "\n")
    _plot(summary, paths["png"], title)
    return paths


# ----------------------------------------------------------------------------------------------
# the command line


@dataclass
class EvalOptions:
    """What is evaluated (precomputed responses or a model's) and where the results go."""

    out: str = option()
    """Output directory."""
    responses: Optional[str] = option(None)
    """jsonl of precomputed responses."""
    load: Optional[str] = option(None, metavar="CKPT")
    """Checkpoint to sample from (needs emapg_megatron.rollout)."""
    k: Optional[str] = option(None)
    """Comma-separated k values (default 1,2,4,..,N)."""
    verbose: bool = option(False, aliases=("-v",))
    """Log more, and print the traceback under an error."""


@dataclass
class MathGrading(PromptConfig):
    """math: how answers are graded (the reward without its format bonus)."""

    timeout: float = option(DEFAULT_TIMEOUT, range=above(0))
    """math: per-check timeout (s)."""
    num_workers: Optional[int] = option(None, flag="--workers", range=at_least(1))
    """math: verifier processes (default: $EMAPG_MATH_WORKERS, else min(4, CPUs))."""
    think_end_tag: Optional[str] = option(None)
    """math: only grade text after this tag."""

    def task_config(self) -> MathConfig:
        """The math task's config: these fields, and the task's defaults for the others."""
        return MathConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


@dataclass
class EvalTask:
    """The task evaluated and its data."""

    name: str = option(flag="--task")
    """math | search (or a registered task)."""
    data_path: tuple[str, ...] = option(deprecated=("--data",))
    """parquet/jsonl file(s)."""
    on_bad_row: str = option("skip", choices=("skip", "error"))
    """A row that cannot be used (a missing field, a bad value): skip it (reported) or stop."""
    limit: Optional[int] = option(None, range=at_least(1))
    """At most this many rows per file."""
    columns: DataColumns = field(default_factory=DataColumns)
    math: MathGrading = field(default_factory=MathGrading)
    search: SearchConfig = field(default_factory=SearchConfig)

    def task_config(self) -> MathConfig | SearchConfig | None:
        """The config of --task math or search (None: a registered task's own defaults)."""
        if self.name == "math":
            return self.math.task_config()
        return self.search if self.name == "search" else None


@dataclass
class Sampling:
    """Generation with --load, as the trainer samples (--temperature 0: greedy)."""

    num_samples: int = option(flag="--num-samples-per-prompt", deprecated=("--n-samples",),
                              range=at_least(1))
    """Responses per prompt (N): the first N of --responses, or N sampled with --load."""
    temperature: float = option(1.0, range=at_least(0))
    """Sampling temperature; 0: greedy."""
    top_p: float = option(1.0, range=between(0, 1, low_open=True))
    """Nucleus sampling threshold in (0, 1]."""
    max_new_tokens: Optional[int] = option(None, range=at_least(1))
    """Tokens of a single-turn response (default 1024); search: each turn's budget only with
    --max-turn-tokens 0."""
    seed: int = option(0, range=ANY_NUMBER)
    """Seed of the sampling."""


@dataclass
class EvaluateConfig:
    """An evaluation: its options, the task and its data, the sampling."""

    run: EvalOptions
    task: EvalTask
    sampling: Sampling

    def check(self) -> None:
        """Each option against its declaration, and one source of responses."""
        for part in configurable.components(self):
            configurable.check_fields(part)
        if (self.run.responses is None) == (self.run.load is None):
            raise ConfigError("give one of --responses FILE or --load CKPT")
        self.ks()

    def ks(self) -> list[int]:
        """The k of Pass@k: --k's values, each from 1 to N (--num-samples-per-prompt); by default
        1, 2, 4, ..., N. ConfigError for anything else."""
        n, given = self.sampling.num_samples, self.run.k
        if not given:
            return default_ks(n)
        try:
            ks = sorted({int(x) for x in given.split(",") if x.strip()})
        except ValueError:
            raise ConfigError(f"--k must be comma-separated integers (got {given!r})") from None
        if not ks or not 1 <= ks[0] <= ks[-1] <= n:
            raise ConfigError(f"--k values must lie in 1..{n} (--num-samples-per-prompt; got {given!r})")
        return ks


class _DeprecatedField(argparse.Action):
    """``--field NAME=COLUMN``, the old spelling of --prompt-key (``question=``) and
    --answer-key (``ground_truth=`` / ``golden_answers=``)."""

    KEYS = {"question": "prompt_key", "ground_truth": "answer_key", "golden_answers": "answer_key"}

    def __call__(self, parser, namespace, value, option_string=None):
        configurable.warn_deprecated(parser, option_string, "--prompt-key / --answer-key")
        name, sep, column = value.partition("=")
        dest = self.KEYS.get(name.strip())
        if not sep or dest is None:
            raise ConfigError(f"--field expects question=COLUMN (--prompt-key) or ground_truth=COLUMN / "
                              f"golden_answers=COLUMN (--answer-key), got {value!r}")
        setattr(namespace, dest, column.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = configurable.ArgumentParser(prog="python -m emapg_megatron.evaluate",
                                         description=__doc__.split("\n\n")[0],
                                         formatter_class=configurable.HelpFormatter)
    configurable.add_arguments(parser, EvaluateConfig)
    parser.add_argument("--field", action=_DeprecatedField, dest=argparse.SUPPRESS, metavar="NAME=COLUMN",
                        help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> EvaluateConfig:
    """The evaluation's config from ``argv``, checked (ConfigError with one line)."""
    cfg = configurable.build(EvaluateConfig, vars(build_parser().parse_args(argv)))
    cfg.check()
    return cfg


def _make_task(cfg: EvalTask) -> Any:
    config = cfg.task_config()
    try:
        return get_task(cfg.name) if config is None else get_task(cfg.name, config=config)
    except (ImportError, ValueError) as e:
        raise EvalError(str(e)) from None


def run(cfg: EvaluateConfig) -> dict:
    opts, data, sampling = cfg.run, cfg.task, cfg.sampling
    n = sampling.num_samples
    ks = cfg.ks()
    _make_output_dir(opts.out)  # a bad --out is found now, not after the scoring
    task = _make_task(data)
    try:
        try:
            ds = task.load(data.data_path if len(data.data_path) > 1 else data.data_path[0],
                           fields=data.columns.fields(data.name), on_bad_row=data.on_bad_row,
                           limit=data.limit)
        except (FileNotFoundError, KeyError, ValueError) as e:
            raise EvalError(str(e).strip('"')) from None
        rows = ds.to_list()
        if not rows:
            raise EvalError("no rows to evaluate")
        if opts.responses:
            responses = read_responses(opts.responses, rows, n)
            source = {"responses": os.path.abspath(opts.responses)}
        else:
            _prepare_load(task, cfg, rows)
            max_new = DEFAULT_MAX_NEW_TOKENS if sampling.max_new_tokens is None else sampling.max_new_tokens
            backend = load_backend(opts.load, temperature=sampling.temperature, top_p=sampling.top_p,
                                   max_new_tokens=max_new, seed=sampling.seed)
            responses = _generate_to_file(task, rows, backend, n, opts.out)
            source = {"checkpoint": opts.load}
        correct = score(task, rows, responses, progress=True)
    finally:
        task.close()
    summary = summarize(rows, correct, ks)
    meta = {"task": data.name, "data": [os.path.abspath(d) for d in data.data_path], "n_samples": n, **source}
    try:
        paths = write_report(opts.out, summary, meta, rows, correct)
    except OSError as e:  # the folder filled up or went away since the start
        raise EvalError(f"--out {opts.out}: cannot write the results ({e.strerror or e})") from None
    return {"summary": summary, "paths": paths}


def _make_output_dir(out: str) -> None:
    """--out as a folder this run can write, made before any work."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise EvalError(f"--out {out} is a file, not a folder")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise EvalError(f"--out {out}: cannot make the folder ({e.strerror or e})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise EvalError(f"--out {out} is not writable")


def main(argv: Optional[Sequence[str]] = None) -> int:
    verbose = False
    try:
        cfg = parse_args(argv)
        verbose = cfg.run.verbose
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        out = run(cfg)
    except (ConfigError, EvalError) as e:
        if verbose and e.__cause__ is not None:
            traceback.print_exception(e.__cause__)
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = out["summary"]
    ks = [k for k in s["ks"] if k != 1]
    print(f"{'data_source':<24} {'n':>5} {'pass@1':>8} " + " ".join(f"{'pass@' + str(k):>9}" for k in ks))
    items = list(s["by_source"].items()) + [("overall", s["overall"])]
    for name, b in items:
        print(f"{name:<24} {b['n_problems']:>5} {b['pass@1']:>8.4f} "
              + " ".join(f"{b['pass@k'][str(k)]:>9.4f}" for k in ks))
    print(f"wrote {out['paths']['json']}, {out['paths']['markdown']}, {out['paths']['png']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
