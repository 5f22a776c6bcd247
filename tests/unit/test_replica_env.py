"""One pod contract: the environment a replica starts with is built by seqtrain.spec.replica_env for both backends.
The same job through the pod builder (k8s/pods/manifests.py) and the local backend (local/gang.py) gives the same
variables and values, except the differences the contract documents as parameters."""

from __future__ import annotations

import pytest

from jobs import make_job
from seqtrain.runtime import launch
from seqtrain.spec import SeqTrainJob
from seqtrain.spec import replica_env as contract
from seqtrain_operator.k8s.owner import Owner
from seqtrain_operator.k8s.pods import manifests as m
from seqtrain_operator.local import gang as local

OWNER = Owner(name="gpt", namespace="ml", uid="1234-abcd")
# Each documented difference: the variable, and the backend that alone sets it (None: both, with other values).
DIFFERENCES = {
    "MASTER_ADDR": None, "MASTER_PORT": None, contract.RESTART_PORT_ENV: None,  # DNS and fixed ports vs loopback
    contract.GRACE_ENV: None,  # each backend's own SIGTERM -> SIGKILL deadline, less the same margin
    "HOME": "pod", "TRITON_CACHE_DIR": "pod", "TORCH_EXTENSIONS_DIR": "pod",  # the pod's root is read-only
    "TORCHINDUCTOR_CACHE_DIR": "pod with a GPU and a claim",  # a GPU pod's compile cache on its checkpoint claim (local: the user's ~/.cache)
    "OMP_NUM_THREADS": "local",  # every local rank shares one machine; a pod's launcher divides the pod's CPUs
    "CUDA_VISIBLE_DEVICES": "local",  # a pod's device plugin shows it its GPUs
    contract.LOG_DIR_ENV: "local",  # a pod's output is its container log
}


def job(replicas: int, gpus: int) -> SeqTrainJob:
    return SeqTrainJob.model_validate(make_job("gpt", "ml", replicas=replicas,
                                               resources={"gpus": gpus, "cpu": "2", "memory": "3Gi"}))


def pod_env(j: SeqTrainJob, attempt: int, replica: int, delays: tuple[float, ...]) -> dict[str, str]:
    pod = m.build_pod(j, OWNER, attempt, replica, m.Settings(), "n1", delays)
    env = pod["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if "value" in e}  # the downward API's are the pod's own identity


@pytest.mark.parametrize(("replicas", "gpus", "delays"), [(2, 0, ()), (3, 4, ()), (2, 0, (1.0, 2.5)), (1, 2, (3.0,))])
def test_the_local_backend_and_the_pod_builder_give_a_replica_the_same_environment(
        replicas: int, gpus: int, delays: tuple[float, ...]) -> None:
    j = job(replicas, gpus)
    procs = j.spec.resources.procs
    for replica in range(replicas):
        pod = pod_env(j, 3, replica, delays)
        mine = local.local_replica_env(replica=replica, attempt=3, replicas=replicas, procs=procs,
                                       gpus_per_replica=gpus, master_port=40000,
                                       log_dir="/tmp/logs" if procs > 1 or delays else None, in_place_delays=delays,
                                       restart_port=40001 if delays else None, job="gpt")
        same = {k for k in pod.keys() & mine.keys() if k not in DIFFERENCES}
        assert {k: pod[k] for k in same} == {k: mine[k] for k in same}
        assert {k for k in pod.keys() ^ mine.keys()} <= {k for k, only in DIFFERENCES.items() if only}, (
            sorted(pod.keys() ^ mine.keys()))
        for name, only in DIFFERENCES.items():
            if only == "pod":
                assert name in pod and name not in mine, name
        assert mine["MASTER_ADDR"] == "127.0.0.1" and pod["MASTER_ADDR"] == "gpt-0.gpt.ml.svc"
        # the same margin before each backend's SIGKILL
        assert float(pod[contract.GRACE_ENV]) == m.Settings().termination_grace_seconds - 5
        assert float(mine[contract.GRACE_ENV]) == local.TERM_GRACE_SECONDS - 5
        assert ("RANK" in pod) == (procs == 1) and pod.get("RANK") == mine.get("RANK")
        if gpus:
            assert mine["CUDA_VISIBLE_DEVICES"] == ",".join(str(g) for g in range(replica * gpus, (replica + 1) * gpus))


def test_what_the_user_sets_for_threads_and_grace_wins_locally() -> None:
    given = {"OMP_NUM_THREADS": "3", contract.GRACE_ENV: "2"}
    env = {**given, **local.local_replica_env(replica=0, attempt=1, replicas=2, procs=2, gpus_per_replica=0,
                                              master_port=1, log_dir="/l", given=given)}
    assert env["OMP_NUM_THREADS"] == "3" and env[contract.GRACE_ENV] == "2"
    env = local.local_replica_env(replica=0, attempt=1, replicas=2, procs=2, gpus_per_replica=0, master_port=1)
    assert int(env["OMP_NUM_THREADS"]) == contract.cpu_share(launch.cpu_budget(), 4)


def test_identity_comes_from_the_contract_only() -> None:
    base = local.process_env({"RANK": "7", "LOCAL_RANK": "1", "NODE_RANK": "2", "PATH": "/bin"})
    assert "RANK" not in base and "NODE_RANK" not in base and base["PATH"] == "/bin"


def test_the_launcher_reads_the_names_the_contract_writes() -> None:
    from seqtrain.runtime import restart

    assert (launch.GRACE_ENV, launch.LOG_DIR_ENV) == (contract.GRACE_ENV, contract.LOG_DIR_ENV)
    assert (restart.DELAYS_ENV, restart.PORT_ENV) == (contract.INPLACE_DELAYS_ENV, contract.RESTART_PORT_ENV)
    # and what it prints of a failed rank is what both backends read back
    assert contract.first_rank_exit("x\nseqtrain launch: local rank 3 exited with code 137\n") == (3, 137)
    assert contract.first_rank_exit("seqtrain launch: exit codes of local ranks ...") is None


def test_in_place_restarts_need_the_coordinator_port() -> None:
    with pytest.raises(ValueError, match="restart_port"):
        contract.replica_env(replica=0, attempt=1, world_size=1, procs=1, master_addr="a", master_port=1,
                             grace_period=30, in_place_delays=(1.0,))
    assert contract.cpu_share(2, 4) == 1 and contract.cpu_share(16, 4) == 4
    assert contract.term_grace_seconds(3) == 1


@pytest.mark.slow
def test_a_running_local_replica_sees_what_its_pod_would(tmp_path) -> None:  # noqa: ANN001
    """The local backend started for real (a fake rank that dumps its environment) against the pod builder."""
    import json
    import sys
    import time

    names = sorted({*pod_env(job(2, 0), 1, 0, ()), *DIFFERENCES} - {"SEQTRAIN_JOB"})
    dump = (f"import json, os; json.dump({{k: os.environ.get(k) for k in {names!r}}}, "
            f"open(r'{tmp_path}/env-' + os.environ['SEQTRAIN_REPLICA'], 'w'))")
    gang = local.LocalGang.start(1, replicas=2, procs_per_replica=1, gpus_per_replica=0, config_path="unused",
                                 log_dir=str(tmp_path / "logs"), command=[sys.executable, "-c", dump])
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"env-{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for replica in range(2):
            ran = {k: v for k, v in json.loads((tmp_path / f"env-{replica}").read_text()).items() if v is not None}
            pod = pod_env(job(2, 0), 1, replica, ())
            same = (pod.keys() & ran.keys()) - DIFFERENCES.keys()
            assert same >= {"WORLD_SIZE", "RANK", "NODE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SEQTRAIN_ATTEMPT",
                            "SEQTRAIN_REPLICA", "PYTHONUNBUFFERED"}
            assert {k: ran[k] for k in same} == {k: pod[k] for k in same}
            assert (pod.keys() - ran.keys()) - {"SEQTRAIN_JOB"} <= {k for k, o in DIFFERENCES.items() if o == "pod"}
    finally:
        gang.stop(grace=0)


@pytest.mark.parametrize(("gpus", "pvc", "where"), [
    (1, "ckpt", "/checkpoints/gpt/.compile-cache"), (0, "ckpt", None), (1, None, None)])
def test_a_gpu_pods_compile_caches_live_on_its_checkpoint_claim(gpus: int, pvc: str | None, where: str | None) -> None:
    """torch.compile's and Triton's caches outlast a GPU pod on the job's claim, so the next attempt's pods start
    with the kernels compiled; without a claim (an emptyDir dies with the pod) or a GPU they stay in /tmp."""
    j = job(2, gpus)
    j.spec.checkpoint.pvc = pvc
    env = pod_env(j, 1, 0, ())
    if where is None:
        assert env["TRITON_CACHE_DIR"] == "/tmp/triton" and "TORCHINDUCTOR_CACHE_DIR" not in env
    else:
        assert (env["TRITON_CACHE_DIR"], env["TORCHINDUCTOR_CACHE_DIR"]) == (f"{where}/triton", f"{where}/inductor")

