"""Reading SeqTrainJob documents: YAML text -> overrides -> typed model -> cross-field checks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml
from pydantic import ValidationError

from seqtrain.spec.bounds import MAX_DEPTH, MAX_NODES, SHAPE, bracket_depth, document_problems
from seqtrain.spec.checks import check
from seqtrain.spec.features import unavailable
from seqtrain.spec.job import API_VERSION, KIND, SeqTrainJob
from seqtrain.spec.problems import Problem, SpecError, from_validation_error

# A spec has hundreds of nodes; a pod template with many sidecars a few thousand. More (bounds.MAX_NODES), once
# aliases are expanded, is an alias bomb (`a: &a [x, x, ...]`, `b: &b [*a, *a, ...]` ...: a few hundred bytes that
# expand to gigabytes).
MAX_INT_DIGITS = 40  # far beyond int64 (19 digits); Python refuses int() of more than 4300 digits with a ValueError


class _SpecLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses duplicate keys (YAML says keys are unique; PyYAML silently keeps the last,
    so `steps: 10` ... `steps: 100000` would run the second) instead of choosing one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {first.start_mark.line + 1}): keep one",
                    key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        digits = sum(ch.isdigit() for ch in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {digits} digits; Kubernetes stores at most 64-bit integers (19 digits)",
                node.start_mark)
        return super().construct_yaml_int(node)  # type: ignore[no-untyped-call, no-any-return]


_SpecLoader.add_constructor("tag:yaml.org,2002:int", _SpecLoader.construct_yaml_int)


def _expanded_size(root: yaml.Node) -> int:
    """Nodes the document has once every alias is expanded, counted without expanding (aliases share nodes), and
    without recursion (a document nested thousands deep is refused by its depth later, not by a RecursionError).
    Counting stops once it passes MAX_NODES; a recursive alias counts once (construction refuses it anyway)."""
    memo: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in memo and not children_done:
            continue
        kids: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            kids = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            kids = [n for pair in node.value for n in pair]
        if children_done:
            memo[id(node)] = min(MAX_NODES + 1, 1 + sum(memo.get(id(k), 1) for k in kids))
            continue
        memo[id(node)] = 1  # in progress: a recursive alias counts once
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in memo)
    return memo[id(root)]


def _load_all(text: str) -> list[Any]:
    if bracket_depth(text.encode("utf-8", "surrogatepass"), 2 * MAX_DEPTH) > 2 * MAX_DEPTH:
        raise SpecError([Problem("<yaml>", f"[ and {{ nested more than {2 * MAX_DEPTH} deep; a SeqTrainJob is "
                                           f"at most {MAX_DEPTH} levels deep")])
    loader = _SpecLoader(text)
    docs = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is not None and _expanded_size(node) > MAX_NODES:
                raise SpecError([Problem("<yaml>", f"document {len(docs) + 1} expands to more than {MAX_NODES} "
                                                   "nodes (through its aliases, if it has any): write it without "
                                                   "&anchors and *aliases, or make it smaller")])
            docs.append(loader.construct_document(node))
    finally:
        loader.dispose()  # type: ignore[no-untyped-call]
    return docs


def _unreadable(exc: BaseException) -> str:
    """One line for what PyYAML's constructors raise beside YAMLError (a date such as 2024-13-45 is a ValueError,
    a document nested thousands deep a RecursionError)."""
    if isinstance(exc, RecursionError):
        return "nested too deeply to be a SeqTrainJob"
    return f"a value that cannot be read ({str(exc)[:200]}); quote it if it is text"


def parse_yaml_documents(text: str) -> list[Any]:
    try:
        docs = [d for d in _load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([Problem("<yaml>", f"{where}malformed YAML ({problem})")]) from None
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise SpecError([Problem("<yaml>", _unreadable(exc))]) from None
    if not docs:
        raise SpecError([Problem("<yaml>", "the file holds no YAML document; expected a SeqTrainJob")])
    return docs


def apply_overrides(doc: dict[str, Any], sets: Iterable[str]) -> dict[str, Any]:
    """Apply `--set a.b.c=VALUE` (VALUE parsed as YAML, so `5` is an int and `[1,2]` a list).

    Paths are relative to `spec` unless they start with `spec.` or `metadata.`.
    """
    problems = []
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append(Problem("--set", f"{item!r} must look like path.to.field=VALUE"))
            continue
        parts = key.strip().split(".")
        if parts[0] not in ("spec", "metadata"):
            parts = ["spec", *parts]
        try:
            values = _load_all(raw) if raw.strip() else [""]
            value = values[0] if values else None
        except yaml.constructor.ConstructorError as exc:  # YAML, but not a value a spec holds (tag, duplicate, int)
            problems.append(Problem("--set", f"{key}: {exc.problem or exc}"))
            continue
        except yaml.YAMLError:
            value = raw  # not YAML: the text itself
        except SpecError as err:
            problems += [Problem("--set", f"{key}: {p.message}") for p in err.problems]
            continue
        except (RecursionError, ValueError, TypeError, OverflowError) as exc:
            problems.append(Problem("--set", f"{key}: {_unreadable(exc)}"))
            continue
        node: Any = doc
        for part in parts[:-1]:
            nxt = node.get(part) if isinstance(node, dict) else None
            if nxt is None:
                nxt = {}
                node[part] = nxt
            if not isinstance(nxt, dict):
                problems.append(Problem("--set", f"{key}: {part} is not an object, so it has no field {parts[-1]!r}"))
                break
            node = nxt
        else:
            node[parts[-1]] = value
    if problems:
        raise SpecError(problems)
    return doc


def parse_job(doc: Any, *, check_features: bool = True) -> SeqTrainJob:
    """Validate one decoded document; raise SpecError with every problem found."""
    if not isinstance(doc, dict):
        raise SpecError([Problem("<document>", f"expected a mapping (a SeqTrainJob), got {type(doc).__name__}")])
    bounds = document_problems(doc)
    if shape := [p for kind, p in bounds if kind in SHAPE]:
        raise SpecError(shape)  # before anything walks it recursively
    values = [p for _, p in bounds]
    head: list[Problem] = []
    if doc.get("apiVersion") != API_VERSION:
        head.append(Problem("apiVersion", f"must be {API_VERSION} (got {doc.get('apiVersion')!r})"))
    if doc.get("kind") != KIND:
        head.append(Problem("kind", f"must be {KIND} (got {doc.get('kind')!r})"))
    if head:
        raise SpecError(head)
    try:
        job = SeqTrainJob.model_validate(doc)
    except ValidationError as err:
        typed = from_validation_error(err, SeqTrainJob)  # a typed field's own bound says more than int64's
        raise SpecError(typed + [p for p in values if p.path not in {t.path for t in typed}]) from None
    if values:
        raise SpecError(values)
    problems = check(job)
    if check_features:
        problems += unavailable(job)
    if problems:
        raise SpecError(problems)
    return job


def load_jobs(text: str, overrides: Iterable[str] = ()) -> list[SeqTrainJob]:
    """All documents of a file; each validated (problems of all documents are collected)."""
    docs = parse_yaml_documents(text)
    jobs, problems = [], []
    multi = len(docs) > 1
    for i, doc in enumerate(docs):
        try:
            if overrides:
                if not isinstance(doc, dict):
                    raise SpecError([Problem("<document>", "expected a mapping (a SeqTrainJob)")])
                doc = apply_overrides(doc, overrides)
            jobs.append(parse_job(doc))
        except SpecError as err:
            prefix = f"[document {i + 1}] " if multi else ""
            problems += [Problem(prefix + p.path, p.message) for p in err.problems]
    if problems:
        raise SpecError(problems)
    return jobs


def load_job(text: str, overrides: Iterable[str] = ()) -> SeqTrainJob:
    jobs = load_jobs(text, overrides)
    if len(jobs) != 1:
        raise SpecError([Problem("<yaml>", f"expected exactly one SeqTrainJob, found {len(jobs)} documents")])
    return jobs[0]


def load_job_file(path: str, overrides: Iterable[str] = ()) -> SeqTrainJob:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([Problem("<file>", f"cannot read: {exc.strerror if isinstance(exc, OSError) else exc}")]) from None
    return load_job(text, overrides)
