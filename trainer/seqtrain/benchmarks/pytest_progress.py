"""A pytest plugin for `seqtrain bench gpu`'s tests part: after every test it rewrites the JSON file named by
`SEQTRAIN_PYTEST_PROGRESS` with the outcomes so far and the test now running.

The part runs under a deadline and is killed there; pytest's JUnit XML is written only at the end, so without
this a killed run says nothing of which test was slow or hung (the first H100 lease lost the whole tests part
that way). Loaded with `-p seqtrain.benchmarks.pytest_progress`; inert when the variable is unset."""

from __future__ import annotations

import json
import os
import time
from typing import Any

ENV = "SEQTRAIN_PYTEST_PROGRESS"
_state: dict[str, Any] = {"passed": [], "failed": [], "skipped": [], "running": None, "running_all": [],
                          "seconds": {}}
_started: dict[str, float] = {}


def _write() -> None:
    path = os.environ.get(ENV)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist the controller, which sees every
        return  # worker's reports, is the one writer
    _state["running_all"] = sorted(_started)  # with xdist several tests run at once
    done = sum(len(_state[k]) for k in ("passed", "failed", "skipped"))
    status = f"running: {_state['running']}" if _state["running"] else f"finished {done} tests"
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"status": status, **_state}, f, indent=2)
    os.replace(tmp, path)  # a kill mid-write leaves the previous file whole


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _state["running"] = nodeid
    _started[nodeid] = time.perf_counter()
    _write()


def pytest_runtest_logreport(report: Any) -> None:
    if report.when == "call" or report.outcome != "passed":  # setup/teardown count only when they fail or skip
        if report.outcome == "skipped":
            _state["skipped"].append(report.nodeid)
        elif report.outcome == "failed":
            _state["failed"].append(f"{report.nodeid} ({report.when})")
        elif report.when == "call":
            _state["passed"].append(report.nodeid)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _state["seconds"][nodeid] = round(time.perf_counter() - _started.pop(nodeid, time.perf_counter()), 1)
    _state["running"] = max(_started, key=_started.__getitem__) if _started else None
    _write()
