"""The operator's Settings are built once from the command line (k8s/main.settings_from) and cannot change after."""

from __future__ import annotations

import dataclasses

import pytest

from seqtrain_operator.k8s.main import build_parser, settings_from


def test_the_command_line_becomes_one_frozen_settings() -> None:
    args = build_parser().parse_args(["--node-lost-grace", "5", "--workers", "8", "--creators", "2", "--api-qps", "50",
                                      "--metrics-port", "9100", "--progress-port", "0", "--scheduler-name",
                                      "volcano=my-volcano", "--webhook-cert-dir", "/certs", "--webhook-port", "8443"])
    s = settings_from(args, {"volcano": "my-volcano"})
    assert (s.node_lost_grace, s.workers, s.creators, s.api_qps, s.metrics_port) == (5.0, 8, 2, 50.0, 9100)
    assert s.poll_progress is False and s.pods.progress_port is None  # 0: not polled
    assert s.pods.scheduler_for("volcano") == "my-volcano"
    assert s.webhook is not None and (s.webhook.port, s.webhook.certfile) == (8443, "/certs/tls.crt")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.workers = 1  # type: ignore[misc]


def test_a_bad_value_is_a_usage_error_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        settings_from(build_parser().parse_args(["--rank-mtbf-hours", "-1"]), {})
    assert exit_.value.code == 2 and "--rank-mtbf-hours -1" in capsys.readouterr().err
