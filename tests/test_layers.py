"""The package's layers: each module imports only from its own unit or a lower layer (no
up-arrows), read statically from every import statement, function-local ones included
(docs/architecture.md, "Layers")."""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "emapg_megatron")

#: Bottom to top. A unit is a subpackage or a top-level module of ``emapg_megatron``.
LAYERS = (
    ("errors", "expected_warnings", "presets"),  # no torch, no Megatron
    ("configurable",),  # the typed configs' machinery: every config module uses it
    ("mcore_compat", "cpu_device"),  # the version gaps and the CPU platform
    ("runtime",),  # process groups, parallel state, devices
    ("multiprocess",),  # ranks forked or spawned with the runtime up
    ("kl", "models", "algo", "tasks"),  # the maths on full tensors, model building, RL algebra, tasks
    ("parallel", "lora"),  # vocab-parallel ops: no RL; LoRA adapters on the model's linears
    ("training",),  # the Megatron machinery: schedules, micro-batches, optimizer steps, data
    ("checkpoint",),  # dist checkpoints of a run, HF <-> Megatron
    ("anchor", "rollout"),  # the KL anchor (EMA, teacher); rollout engines and collection
    ("step",),  # one RL step's passes, metrics and checkpoint state
    ("trainer",),  # the orchestration of a step
    ("run",),  # the run's shell: loop, outputs, locks, metrics files
    ("arguments",),  # the trainer's config tree and the rules that join its components
    ("build", "evaluate"),  # a run's components from its config; emapg-evaluate
    ("train",),  # the trainer's entry point
    ("launch", "__init__"),  # emapg-train: validation, then torchrun
)
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _unit(path: str) -> str:
    rel = os.path.relpath(path, PACKAGE)
    return rel.split(os.sep)[0] if os.sep in rel else rel[:-3]


def _imported_units(path: str, module: str) -> set[tuple[str, int]]:
    """``(unit, line)`` of every package unit ``path`` imports (absolute or relative)."""
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importing module
                base = module.split(".")[:-node.level] + (node.module.split(".") if node.module else [])
            else:
                base = (node.module or "").split(".")
            if base[0] != "emapg_megatron":
                continue
            names = [base[1]] if len(base) > 1 else [a.name for a in node.names]
            out |= {(n, node.lineno) for n in names}
        elif isinstance(node, ast.Import):
            out |= {(a.name.split(".")[1], node.lineno) for a in node.names
                    if a.name.startswith("emapg_megatron.")}
    return out


def _modules():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                yield path, rel.removesuffix(".__init__")


def test_every_unit_has_a_layer():
    units = {_unit(path) for path, _ in _modules()} | {
        name for name in os.listdir(PACKAGE) if os.path.isdir(os.path.join(PACKAGE, name)) and name != "__pycache__"}
    assert units == set(LAYER), f"units without a layer: {units - set(LAYER)}; stale: {set(LAYER) - units}"


@pytest.mark.parametrize("path, module", [pytest.param(p, m, id=m) for p, m in _modules()])
def test_imports_point_down(path, module):
    unit = _unit(path)
    up = [f"line {line}: {unit} imports {target}" for target, line in sorted(_imported_units(path, module))
          if target != unit and LAYER.get(target, -1) >= LAYER[unit]]
    assert not up, f"{module}: " + "; ".join(up)
