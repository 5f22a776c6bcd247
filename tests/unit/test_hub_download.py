"""The hf:// downloader against a local server that speaks the hub's file API (no network): the revision's file
list, resolve with a redirect of LFS files to another host (the token does not follow), retries, Range resume,
size and sha256 checks, path traversal refused, atomic and done once (a marker written last)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from seqtrain.hub.__main__ import main as hub_main
from seqtrain.hub.download import MARKER, Hub, HubError, HubModel, download

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_test_token"
WEIGHTS = os.urandom(3 << 20) + b"end"  # over one read chunk, served from the "CDN"
FILES = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b'{"version": "1.0"}',
         "model.safetensors": WEIGHTS, "pytorch_model.bin": b"duplicate weights: not downloaded",
         "original/consolidated.pth": b"sub-folder: not downloaded", "README.md": b"# card"}


class Hub_:
    """State of the fake hub and its CDN: what is listed, what each request saw, failures to inject."""

    def __init__(self) -> None:
        self.files = dict(FILES)
        self.listing_extra: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str, str | None, str | None]] = []  # (server, path, auth, range)
        self.fail_next: dict[str, int] = {}  # path -> how many 500s (or cut-off bodies: "cut:" prefix) first
        self.cut_next: dict[str, int] = {}
        self.need_token = True
        self.lie_sha = False
        self.lie_blob = False


def serve(state: Hub_) -> Iterator[tuple[str, str]]:
    servers: dict[str, ThreadingHTTPServer] = {}

    class Handler(BaseHTTPRequestHandler):
        server_version = "fakehub"

        def log_message(self, *args: Any) -> None:  # noqa: ANN401
            pass

        def do_GET(self) -> None:  # noqa: N802
            role = "cdn" if self.server is servers["cdn"] else "hub"
            auth = self.headers.get("Authorization")
            state.requests.append((role, self.path, auth, self.headers.get("Range")))
            path = self.path.split("?")[0]
            if state.fail_next.get(path, 0) > 0:
                state.fail_next[path] -= 1
                return self._send(500, b"busy")
            if role == "hub" and state.need_token and auth != f"Bearer {TOKEN}":
                return self._send(401, b"gated")
            if role == "hub" and path == "/api/models/org/tiny/revision/main":
                siblings = [{"rfilename": n, "size": len(b)} for n, b in state.files.items()]
                for s in siblings:  # git's blob id of the content (an LFS file's is its pointer's: not checked)
                    body = b"x" if state.lie_blob else state.files[s["rfilename"]]
                    s["blobId"] = hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()
                    if s["rfilename"].endswith(".safetensors"):
                        digest = hashlib.sha256(b"x" if state.lie_sha else state.files[s["rfilename"]]).hexdigest()
                        s["lfs"] = {"sha256": digest, "size": s["size"]}
                body = json.dumps({"id": "org/tiny", "sha": COMMIT, "siblings": siblings + state.listing_extra})
                return self._send(200, body.encode())
            prefix = f"/org/tiny/resolve/{COMMIT}/"
            if role == "hub" and path.startswith(prefix) and path[len(prefix):] in state.files:
                name = path[len(prefix):]
                if name.endswith(".safetensors"):  # LFS: redirect to the CDN, another host
                    self.send_response(302)
                    self.send_header("Location", f"{base['cdn']}/blobs/{name}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                return self._send(200, state.files[name])
            if role == "cdn" and path.startswith("/blobs/"):
                data = state.files[path[len("/blobs/"):]]
                rng = self.headers.get("Range")
                start = int(rng.removeprefix("bytes=").rstrip("-")) if rng else 0
                if state.cut_next.get(path, 0) > 0:  # send the headers of the whole, then only half: cut off
                    state.cut_next[path] -= 1
                    self.send_response(206 if start else 200)
                    self.send_header("Content-Length", str(len(data) - start))
                    self.end_headers()
                    self.wfile.write(data[start:start + (len(data) - start) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return None
                return self._send(206 if start else 200, data[start:])
            return self._send(404, b"no such thing")

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    base = {}
    for role in ("hub", "cdn"):
        servers[role] = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        base[role] = f"http://127.0.0.1:{servers[role].server_address[1]}"
        threading.Thread(target=servers[role].serve_forever, daemon=True).start()
    try:
        yield base["hub"], base["cdn"]
    finally:
        for s in servers.values():
            s.shutdown()
            s.server_close()


@pytest.fixture
def fake() -> Iterator[tuple[Hub_, str]]:
    state = Hub_()
    gen = serve(state)
    hub_url, _ = next(gen)
    yield state, hub_url
    with pytest.raises(StopIteration):
        next(gen)


def quiet(_: str) -> None:
    pass


def test_downloads_the_model_files_once_with_the_token_kept_from_the_cdn(fake, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    state, url = fake
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    folder = download("hf://org/tiny", str(tmp_path), log=quiet)
    assert folder == str(tmp_path / "org--tiny" / "main")
    got = sorted(p for p in os.listdir(folder) if not p.startswith("."))
    assert got == ["config.json", "model.safetensors", "tokenizer.json"]  # no .bin, README, sub-folder
    assert (Path(folder) / "model.safetensors").read_bytes() == WEIGHTS
    marker = json.loads((Path(folder) / MARKER).read_text())
    assert marker["commit"] == COMMIT and marker["repo"] == "org/tiny"
    assert not (tmp_path / "org--tiny" / "main.partial").exists()
    assert all(auth == f"Bearer {TOKEN}" for role, _, auth, _ in state.requests if role == "hub")
    cdn = [r for r in state.requests if r[0] == "cdn"]
    assert cdn and all(auth is None for _, _, auth, _ in cdn)  # the token never leaves the hub's host
    before = len(state.requests)
    assert download("hf://org/tiny", str(tmp_path), log=quiet) == folder
    assert len(state.requests) == before  # complete: not one request


def test_retries_and_resumes_a_cut_off_file(fake, tmp_path: Path) -> None:
    state, url = fake
    state.fail_next["/api/models/org/tiny/revision/main"] = 2
    state.cut_next["/blobs/model.safetensors"] = 1
    sleeps: list[float] = []
    folder = download("hf://org/tiny", str(tmp_path), hub=Hub(url, TOKEN, sleep=sleeps.append), log=quiet)
    assert (Path(folder) / "model.safetensors").read_bytes() == WEIGHTS
    ranges = [rng for role, path, _, rng in state.requests if role == "cdn"]
    assert ranges[0] is None and ranges[1] == f"bytes={(len(WEIGHTS)) // 2}-"  # the rest only
    assert len(sleeps) == 3


def test_refusals_are_one_line(fake, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    state, url = fake
    with pytest.raises(HubError, match="answered 401; the model is gated or private"):
        download("hf://org/tiny", str(tmp_path), hub=Hub(url, None), log=quiet)
    with pytest.raises(HubError, match=r"not found on .* \(404\)"):
        download("hf://org/other", str(tmp_path), hub=Hub(url, TOKEN), log=quiet)
    state.lie_sha = True
    with pytest.raises(HubError, match="model.safetensors does not have the sha256"):
        download("hf://org/tiny", str(tmp_path / "a"), hub=Hub(url, TOKEN), log=quiet)
    assert not (tmp_path / "a" / "org--tiny" / "main").exists()  # nothing half-done where the ranks read
    state.lie_sha = False
    state.lie_blob = True
    with pytest.raises(HubError, match="config.json does not have the git blob id"):
        download("hf://org/tiny", str(tmp_path / "a2"), hub=Hub(url, TOKEN), log=quiet)
    state.lie_blob = False
    with pytest.raises(HubError, match="more than the 1000-byte cap per file"):
        download("hf://org/tiny", str(tmp_path / "b"), hub=Hub(url, TOKEN), max_file=1000, log=quiet)
    with pytest.raises(HubError, match="more than the 100000-byte cap"):
        download("hf://org/tiny", str(tmp_path / "c"), hub=Hub(url, TOKEN), max_total=100_000, log=quiet)
    state.fail_next["/api/models/org/tiny/revision/main"] = 10
    with pytest.raises(HubError, match="answered 500"):
        download("hf://org/tiny", str(tmp_path / "d"), hub=Hub(url, TOKEN, retries=2, sleep=quiet), log=quiet)
    state.fail_next.clear()
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert hub_main(["hf://org/tiny", "--root", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "401" in err and "HF_TOKEN" in err


@pytest.mark.parametrize("name", ["../escape.json", "/etc/passwd.json", "a/../../b.json", "a//b.json", "./c.json",
                                  "x\\..\\y.json", ""])
def test_a_file_name_that_leaves_the_folder_is_refused(fake, tmp_path: Path, name: str) -> None:
    state, url = fake
    state.listing_extra = [{"rfilename": name, "size": 2}]
    with pytest.raises(HubError, match="would leave the download folder; refused"):
        download("hf://org/tiny", str(tmp_path / "dl"), hub=Hub(url, TOKEN), log=quiet)
    assert not (tmp_path / "escape.json").exists() and not (tmp_path / "dl" / "org--tiny" / "main").exists()


@pytest.mark.parametrize("uri", ["hf://org", "hf://org/name/extra", "hf://../x", "hf://org/..", "hf://org/n@../x",
                                 "http://org/name"])
def test_bad_uris_are_refused(uri: str) -> None:
    with pytest.raises(HubError, match="hf://ORG/NAME|revision"):
        HubModel.parse(uri)


def test_revision_folder_is_quoted() -> None:
    m = HubModel.parse("hf://org/tiny@refs/pr/1")
    assert (m.repo, m.revision) == ("org/tiny", "refs/pr/1")
    assert m.folder("/ck") == "/ck/org--tiny/refs%2Fpr%2F1"
