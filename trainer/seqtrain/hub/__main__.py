"""`python -m seqtrain.hub hf://ORG/NAME[@REVISION] --root DIR`: the init container's command (exit 0: the model
is complete in DIR/ORG--NAME/<revision>; 2: refused or failed, one line on stderr, which Kubernetes shows as the
init container's termination message)."""

from __future__ import annotations

import argparse
import os
import sys

from seqtrain.hub.download import MAX_FILE_BYTES, MAX_TOTAL_BYTES, HubError, download


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m seqtrain.hub", description=__doc__)
    p.add_argument("uri", help="hf://ORG/NAME[@REVISION]")
    p.add_argument("--root", required=True, help="folder the model lands in (below it: ORG--NAME/<revision>)")
    p.add_argument("--max-total-bytes", type=int, default=MAX_TOTAL_BYTES)
    p.add_argument("--max-file-bytes", type=int, default=MAX_FILE_BYTES)
    args = p.parse_args(argv)
    try:
        download(args.uri, args.root, max_total=args.max_total_bytes, max_file=args.max_file_bytes,
                 log=lambda line: print(line, flush=True))
    except (HubError, OSError) as exc:
        msg = f"seqtrain hub: {exc}".splitlines()[0]
        print(msg, file=sys.stderr)
        if os.environ.get("KUBERNETES_SERVICE_HOST"):  # in a pod: Kubernetes shows this file as the reason
            try:
                with open("/dev/termination-log", "w", encoding="utf-8") as f:
                    f.write(msg[:4000])
            except OSError:
                pass
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
