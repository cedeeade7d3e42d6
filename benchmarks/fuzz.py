"""The fuzzing tier at full size: requests drawn from the API's own schemas plus the hostile
list, against a real `pdserve serve` (the default 1P1D; or --url for a running one on this
machine), and what must hold: no 5xx, no engine replaced, every pool healthy at every look, no
KV block held 2 s after the last answer (tests/helpers/fuzz.py).
Prints the account and writes results/fuzz.json:
    python benchmarks/fuzz.py [--requests 2000] [--seed 1] [--url URL --api-key KEY]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.conftest import finish_server, start_server  # noqa: E402
from tests.helpers import fuzz  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--url", help="a running pdserve on this machine (default: start one)")
    parser.add_argument("--api-key")
    parser.add_argument("--out", default=str(REPO / "results/fuzz.json"))
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with tempfile.TemporaryDirectory(prefix="pdserve-fuzz-") as work:
        server = None
        if args.url:
            import httpx

            url = args.url.rstrip("/")
            model = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()
            model = model["data"][0]["id"]
        else:
            config = Path(work) / "pdserve.yaml"
            config.write_text("router: {api_key: fuzz-key}\n")
            server = start_server(Path(work), "--config", str(config), api_key="fuzz-key")
            url, model, headers = server.url, server.model, server.headers
        try:
            report = fuzz.run(url, headers, model, args.requests, args.seed, args.concurrency)
        finally:
            if server is not None:
                finish_server(server)
    summary = report.summary() | {"seed": args.seed, "hostile": len(fuzz.HOSTILE)}
    summary["problem_list"] = report.problems()[:50]
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
