"""The launcher's glibc malloc defaults: every rank gets them unless the user set them (then the user's value wins),
and a rank started without the launcher applies the same with mallopt(3) before it allocates its model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from seqtrain.runtime.launch import MALLOC_DEFAULTS, malloc_env, rank_envs


def test_every_rank_gets_the_defaults_the_user_did_not_set() -> None:
    envs = rank_envs(2, {"MALLOC_ARENA_MAX": "8"})
    for env in envs:
        assert env["MALLOC_MMAP_THRESHOLD_"] == MALLOC_DEFAULTS["MALLOC_MMAP_THRESHOLD_"] == str(2**20)
        assert env["MALLOC_TRIM_THRESHOLD_"] == str(2**20)
        assert "MALLOC_ARENA_MAX" not in env  # the user's 8 stays in the inherited environment
    assert malloc_env({k: "1" for k in MALLOC_DEFAULTS}) == {}


@pytest.mark.slow
def test_a_rank_without_the_launcher_applies_them_with_mallopt() -> None:
    code = "import json; from seqtrain.runtime.launch import apply_malloc_defaults; " \
           "print(json.dumps(apply_malloc_defaults()))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == MALLOC_DEFAULTS
    env["MALLOC_ARENA_MAX"] = "4"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {k: v for k, v in MALLOC_DEFAULTS.items() if k != "MALLOC_ARENA_MAX"}
