#!/usr/bin/env bash
# Dry-run the Dockerfile's pip steps on this machine, without Docker:
#
#   bash docker/check_pip_steps.sh [docker/Dockerfile]
#
# Every `pip install` in a RUN instruction is extracted, its ARG defaults substituted and its
# container paths mapped back to the repository through the COPY instructions, then run as
# `pip install --dry-run --report` under the same kind of constraint file the image uses: the
# torch stack as installed *here* (so on a CPU machine, the CPU torch). A step passes when pip
# resolves it without installing or changing any constrained package (no second torch); steps
# that need the image itself (the vLLM source tree cloned during the build) are skipped, with
# the reason. Needs PyPI access; nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "$(bash tools/python.sh)" - "${1:-docker/Dockerfile}" <<'PY'
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

STACK = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch-triton|transformer[-_]engine[-_a-z0-9]*|apex|"
                   r"flash[-_]attn[-_a-z0-9]*)==", re.I)


def instructions(path):
    """(keyword, argument) per Dockerfile instruction, continuation lines joined."""
    out, buf = [], ""
    for raw in open(path, encoding="utf-8"):
        line = raw.rstrip("\n")
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, rest = buf.strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buf = ""
    return out


def substitute(text, env):
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)


def map_path(path, workdir, copies):
    """A repository path for a container path, or None (only exists inside the image)."""
    full = path if path.startswith("/") else os.path.normpath(os.path.join(workdir, path))
    for dst, src in copies:
        if full == dst:
            return src
        if full.startswith(dst.rstrip("/") + "/") and os.path.isdir(src):
            return os.path.join(src, os.path.relpath(full, dst))
    return None


def pip_steps(path):
    args, workdir, copies, steps = {}, "/", [], []
    for keyword, rest in instructions(path):
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default.strip('"')
        elif keyword == "WORKDIR":
            workdir = substitute(rest, args)
        elif keyword == "COPY":
            *srcs, dst = shlex.split(rest)
            copies.append((dst, os.path.normpath(srcs[0])))
        elif keyword == "RUN":
            for command in rest.split("&&"):
                if re.search(r"\bpip install\b", command):
                    steps.append((substitute(command.strip(), args), workdir, list(copies)))
    return steps


def translate(command, workdir, copies):
    """(pip arguments, None) or (None, reason to skip)."""
    words = shlex.split(command)
    while words and re.match(r"^\w+=", words[0]):  # VAR=value prefixes (PIP_CONSTRAINT, ...)
        words.pop(0)
    words = words[words.index("install") + 1:]
    out, expect_file = [], False
    for w in words:
        if "$" in w:
            return None, f"uses a shell variable set during the build ({w})"
        if expect_file or not w.startswith("-"):
            spec, extras = (w.split("[", 1) + [""])[:2] if "[" in w else (w, "")
            local = spec.startswith(("/", ".")) or expect_file
            if local:
                mapped = map_path(spec, workdir, copies)
                if mapped is None:
                    return None, f"needs {spec} from inside the image (workdir {workdir})"
                w = mapped + (f"[{extras}" if extras else "")
            expect_file = False
        elif w in ("-r", "--requirement", "-c", "--constraint", "-e", "--editable"):
            expect_file = True
        out.append(w)
    return out, None


def vllm_pin(dockerfile, tmp):
    """The torch that the pinned vLLM release was built for (it is compiled in the image against
    NGC's torch instead; the two should share a minor version)."""
    version = next((rest.partition("=")[2].strip('"') for kw, rest in instructions(dockerfile)
                    if kw == "ARG" and rest.startswith("VLLM_VERSION=")), None)
    if version is None:
        return
    report = os.path.join(tmp, "vllm.json")
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps",
                          "--ignore-installed", "--report", report, f"vllm=={version}"],
                         capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                              if k != "PIP_CONSTRAINT"})
    if run.returncode != 0:
        print(f"\n[vllm] vllm=={version} is not on the index:\n{run.stderr.strip()[-1000:]}")
        return
    requires = json.load(open(report))["install"][0]["metadata"].get("requires_dist", [])
    torch_pins = [r for r in requires if re.match(r"^torch\b", r) and "extra ==" not in r]
    print(f"\n[vllm] vllm=={version} exists; its PyPI wheel pins {', '.join(torch_pins) or 'no torch'}")


def main(dockerfile):
    with tempfile.TemporaryDirectory() as tmp:
        frozen = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"],
                                capture_output=True, text=True, check=True).stdout.splitlines()
        stack = [line for line in frozen if STACK.match(line)]
        constraints = os.path.join(tmp, "torch-stack-constraints.txt")
        with open(constraints, "w") as f:
            f.write("\n".join(stack) + "\n")
        stack_names = {re.split("==", s)[0].lower().replace("_", "-") for s in stack}
        print(f"torch stack held fixed (as installed here): {', '.join(stack) or 'none'}")
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for i, (command, workdir, copies) in enumerate(pip_steps(dockerfile), 1):
            pip_args, reason = translate(command, workdir, copies)
            print(f"\n[{i}] {command}")
            if pip_args is None:
                print(f"    SKIP: {reason}")
                counts["skipped"] += 1
                continue
            report = os.path.join(tmp, f"report{i}.json")
            cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", report,
                   *pip_args]
            print("    $ " + " ".join(shlex.quote(c) for c in cmd[2:]))
            run = subprocess.run(cmd, capture_output=True, text=True,
                                 env={**os.environ, "PIP_CONSTRAINT": constraints})
            if run.returncode != 0:
                print("    FAIL: pip could not resolve it:\n" + run.stderr.strip()[-2000:])
                counts["failed"] += 1
                continue
            installs = json.load(open(report))["install"]
            names = [f"{x['metadata']['name']}=={x['metadata']['version']}" for x in installs]
            touched = [n for n in names if n.split("==")[0].lower().replace("_", "-") in stack_names]
            print(f"    would install {len(names)}: {' '.join(names) or '-'}")
            # Installed packages hide the named requirements above: resolve them alone, from PyPI.
            fresh = subprocess.run([*cmd[:4], "--ignore-installed", "--no-deps", *cmd[4:]],
                                   capture_output=True, text=True,
                                   env={**os.environ, "PIP_CONSTRAINT": constraints})
            if fresh.returncode == 0:
                alone = json.load(open(report))["install"]
                print("    named, from scratch: " + " ".join(
                    f"{x['metadata']['name']}=={x['metadata']['version']}" for x in alone))
            if touched or fresh.returncode != 0:
                print(f"    FAIL: " + (f"would replace the torch stack: {' '.join(touched)}" if touched
                                      else "not resolvable from scratch:\n" + fresh.stderr.strip()[-2000:]))
                counts["failed"] += 1
            else:
                print("    PASS")
                counts["passed"] += 1
        vllm_pin(dockerfile, tmp)
        print(f"\n{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
        return 1 if counts["failed"] else 0


sys.exit(main(sys.argv[1]))
PY
