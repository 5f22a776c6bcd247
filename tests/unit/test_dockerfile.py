"""Static checks of the Dockerfile (no Docker here): stages, bases, entrypoints, users, what each image installs."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)  # join continuation lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for op, rest in instructions():
        if op == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            assert m and m.group(2), f"every stage is named: FROM {rest}"
            current = m.group(2)
            out[current] = [(op, m.group(1))]
        elif current is not None:
            out[current].append((op, rest))
    return out


def test_stages_and_bases():
    s = stages()
    assert list(s) == ["builder", "operator", "trainer"]
    args = dict(re.match(r"(\w+)=(\S+)", rest).groups() for op, rest in instructions()[:2] if op == "ARG")
    assert args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    assert args["TRAINER_BASE"] == "${PYTHON_IMAGE}"  # CPU by default, a CUDA base by --build-arg
    assert s["trainer"][0] == ("FROM", "${TRAINER_BASE}")
    assert s["operator"][0] == ("FROM", "${PYTHON_IMAGE}")


def test_entrypoints_are_exec_form():
    s = stages()
    assert ("ENTRYPOINT", '["seqtrain", "operator"]') in s["operator"]
    assert ("ENTRYPOINT", '["seqtrain", "train"]') in s["trainer"]


def test_final_images_run_as_non_root():
    for name in ("operator", "trainer"):
        users = [rest for op, rest in stages()[name] if op == "USER"]
        assert users and users[-1].split(":")[0] not in ("0", "root"), name


def test_operator_image_has_no_torch_and_trainer_has_the_stack():
    s = stages()
    op_runs = " ".join(rest for op, rest in s["operator"] if op == "RUN")
    assert "[operator]" in op_runs and "torch" not in op_runs and "[train]" not in op_runs
    tr_runs = " ".join(rest for op, rest in s["trainer"] if op == "RUN")
    assert "[train]" in tr_runs and "torch==${TORCH_VERSION}" in tr_runs and "${TORCH_INDEX_URL}" in tr_runs
    trainer_args = {rest.split("=")[0]: rest.split("=", 1)[1] for op, rest in s["trainer"] if op == "ARG"}
    assert trainer_args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    # the train extra brings deepspeed and triton (pyproject)
    pyproject = (ROOT / "pyproject.toml").read_text()
    train_extra = pyproject.split("train = [")[1].split("]")[0]
    assert "deepspeed" in train_extra and "triton" in train_extra
    operator_extra = pyproject.split("operator = [")[1].split("]")[0]
    assert "torch" not in operator_extra


def test_copied_paths_exist_and_context_is_small():
    for op, rest in instructions():
        if op == "COPY" and "--from" not in rest:
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), src
    ignored = (ROOT / ".dockerignore").read_text().split()
    for heavy in (".git", ".venv", ".tools", "runs", ".cache"):
        assert heavy in ignored
    for needed in ("trainer", "operator", "pyproject.toml", "README.md"):
        assert needed not in ignored


def test_makefile_builds_both_targets():
    mk = (ROOT / "Makefile").read_text()
    assert "scripts/images.sh $(TRAINER_IMAGE) $(OPERATOR_IMAGE)" in mk
    script = (ROOT / "scripts" / "images.sh").read_text()  # docker build or buildah bud, one target after the other
    assert "for target in trainer operator; do" in script
    assert script.count('--target "$target" -t "$image"') == 2
