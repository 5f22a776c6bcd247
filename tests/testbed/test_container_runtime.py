"""The container nodes' kubelet rules (tests/testbed/containers.py), without a runtime: what `podman run` is told."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testbed.containers import apply_fs_group, entry_args, merged_security, security_args

TRAINER_SC = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
              "capabilities": {"drop": ["ALL"]}}
POD_SC = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
          "seccompProfile": {"type": "RuntimeDefault"}}


def test_the_trainer_pod_security_context_becomes_user_groups_read_only_root_and_no_capabilities() -> None:
    sc = merged_security({"securityContext": POD_SC}, {"securityContext": TRAINER_SC})
    args = security_args(sc, [1000], "1000:1000")
    assert args[args.index("--user") + 1] == "1000:1000"
    assert args[args.index("--group-add") + 1] == "1000"
    # podman would otherwise put writable tmpfs on /tmp, /var/tmp and /run of a read-only root: a kubelet does not.
    assert "--read-only" in args and "--read-only-tmpfs=false" in args
    assert args[args.index("--cap-drop") + 1] == "ALL"
    assert args[args.index("--security-opt") + 1] == "no-new-privileges"


def test_the_container_security_context_wins_over_the_pod_one() -> None:
    sc = merged_security({"securityContext": {"runAsUser": 1000}}, {"securityContext": {"runAsUser": 2000}})
    assert sc["runAsUser"] == 2000


@pytest.mark.parametrize(("image_user", "message"), [
    ("", "image will run as root"), ("0", "image will run as root"), ("seqtrain", "non-numeric user")])
def test_run_as_non_root_refuses_an_image_that_runs_as_root_or_an_unverifiable_user(image_user: str,
                                                                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        security_args({"runAsNonRoot": True}, [], image_user)
    with pytest.raises(ValueError, match="non-root"):
        security_args({"runAsNonRoot": True, "runAsUser": 0}, [], "1000")
    assert "--user" not in security_args({"runAsNonRoot": True}, [], "1000:1000")  # the image's user stands


def test_command_replaces_the_entrypoint_args_replace_cmd_and_vars_expand() -> None:
    env = {"RANK": "1"}
    assert entry_args({"command": ["seqtrain", "train"], "args": ["--rank=$(RANK)", "$$(RANK)"]}, env) == (
        ["seqtrain", "train"], ["--rank=1", "$(RANK)"])
    assert entry_args({"args": ["--all-namespaces"]}, env) == (None, ["--all-namespaces"])
    assert entry_args({}, env) == (None, None)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another group needs root")
def test_fs_group_owns_a_volume_as_the_kubelet_does_and_on_root_mismatch_only_once(tmp_path: Path) -> None:
    vol = tmp_path / "vol"
    (vol / "sub").mkdir(parents=True)
    (vol / "sub" / "f").write_text("x")
    apply_fs_group(vol, 1000, "OnRootMismatch")
    for p in (vol, vol / "sub", vol / "sub" / "f"):
        assert p.stat().st_gid == 1000 and p.stat().st_mode & 0o060 == 0o060
    assert (vol / "sub").stat().st_mode & 0o2000  # setgid: new files keep the group
    (vol / "sub" / "g").write_text("y")
    os.chown(vol / "sub" / "g", -1, 0)
    apply_fs_group(vol, 1000, "OnRootMismatch")  # the root matches: nothing is walked
    assert (vol / "sub" / "g").stat().st_gid == 0
    apply_fs_group(vol, 1000, None)  # Always
    assert (vol / "sub" / "g").stat().st_gid == 1000
