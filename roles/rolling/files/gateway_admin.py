"""Hold an inference host out of one gateway's pool, wait, return it (runs on the gateway's host).

Run with any Python 3 on the gateway's host (stdlib only):
    python -I gateway_admin.py '<json>'
with json {"admin_file": PATH, "action": ACTION, "port": PORT, "addresses": [HOST, ...],
"timeout_s": SECONDS}. PATH is the gateway role's llmhost-gateway-admin.json ({"url",
"key_file"}): where the admin API answers on this host and the file of its key, read
here, so the key never leaves the host. The upstreams acted on are those the gateway
lists (GET /admin/upstreams) as HOST:PORT with PORT and one of the ADDRESSES.

ACTION is one of
- hold: POST /admin/upstreams/{target}/hold for each (no new requests go there);
  refused (exit 1) when the gateway has other upstreams and none of them is in service
  and not held: the hold would leave it nothing to send requests to (e.g. a roll that
  failed earlier left another host held);
- drained: wait up to timeout_s until their requests in flight are 0; a wait that
  runs out is reported (drained: false), not an error: the host's own stop drains
  what is left;
- return: POST /admin/upstreams/{target}/return for each;
- in_service: wait up to timeout_s until the gateway has each in service again; exit 1
  if one is not by then.

Prints one JSON object: gateway (false: no admin file, so no gateway runs here),
targets, changed (a hold or return that changed a target's state), the targets'
upstream entries as last read, and for the waits drained/in_service and waited_s.
Exits 1 with {"error": ...} when the admin API cannot be used.
"""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

POLL_S = 0.5


class AdminError(Exception):
    pass


def split_target(target: str) -> tuple[str, str]:
    """HOST:PORT (IPv6 in brackets) as (host without brackets, port)."""
    host, _, port = target.rpartition(":")
    return host.strip("[]"), port


def matching(upstreams: list[dict[str, Any]], addresses: list[str], port: int) -> list[str]:
    names = {a.strip("[]") for a in addresses}
    return [u["target"] for u in upstreams
            if split_target(u["target"])[1] == str(port) and split_target(u["target"])[0] in names]


class Admin:
    def __init__(self, url: str, key: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.key = key
        self.timeout_s = timeout_s
        # The admin API is reached on this host's own address: its certificate names
        # the gateway's public name, not this address (the role's checks do the same).
        self.context = ssl.create_default_context()
        self.context.check_hostname = False
        self.context.verify_mode = ssl.CERT_NONE

    def call(self, method: str, path: str) -> list[dict[str, Any]]:
        request = urllib.request.Request(f"{self.url}{path}", method=method, data=b"" if method == "POST" else None,
                                         headers={"Authorization": f"Bearer {self.key}"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.context) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")[:500]
            raise AdminError(f"{method} {self.url}{path}: HTTP {exc.code} {detail}") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise AdminError(f"{method} {self.url}{path}: {exc}") from exc
        return list(body["upstreams"])

    def upstreams(self) -> list[dict[str, Any]]:
        return self.call("GET", "/admin/upstreams")

    def set_held(self, target: str, held: bool) -> list[dict[str, Any]]:
        action = "hold" if held else "return"
        return self.call("POST", f"/admin/upstreams/{urllib.parse.quote(target, safe='')}/{action}")


def of(upstreams: list[dict[str, Any]], targets: list[str]) -> list[dict[str, Any]]:
    return [u for u in upstreams if u["target"] in targets]


def check_others_serve(upstreams: list[dict[str, Any]], targets: list[str], url: str) -> None:
    """Raise AdminError where holding TARGETS would leave the gateway at URL without an
    upstream in service, while it has others (a gateway of one host has no other)."""
    fresh = [u for u in of(upstreams, targets) if not u["held"]]
    others = [u for u in upstreams if u["target"] not in targets]
    if not fresh or not others or any(u["state"] == "in_service" and not u["held"] for u in others):
        return
    shown = ", ".join(f"{u['target']} ({'held' if u['held'] else u['state']})" for u in others)
    raise AdminError(f"holding {', '.join(u['target'] for u in fresh)} would leave the gateway at {url} with no "
                     f"upstream in service: the others are {shown}. Bring one of them back first (a roll that "
                     "failed leaves its host held until its change passes), then roll again")


def wait(admin: Admin, targets: list[str], done: Any, timeout_s: float) -> tuple[bool, list[dict[str, Any]], float]:
    """Poll until DONE(entries of TARGETS) or TIMEOUT_S: (done, last entries, seconds waited)."""
    start = time.monotonic()
    while True:
        entries = of(admin.upstreams(), targets)
        if done(entries):
            return True, entries, time.monotonic() - start
        if time.monotonic() - start >= timeout_s:
            return False, entries, time.monotonic() - start
        time.sleep(POLL_S)


def run(request: dict[str, Any], admin: Admin | None = None) -> dict[str, Any]:
    action = request["action"]
    if admin is None:
        try:
            with open(request["admin_file"], encoding="utf-8") as f:
                described = json.load(f)
        except FileNotFoundError:
            return {"gateway": False, "targets": [], "changed": False}
        with open(described["key_file"], encoding="utf-8") as f:
            admin = Admin(described["url"], f.read().strip())
    upstreams = admin.upstreams()
    targets = matching(upstreams, list(request["addresses"]), int(request["port"]))
    out: dict[str, Any] = {"gateway": True, "url": admin.url, "targets": targets, "changed": False}
    timeout_s = float(request.get("timeout_s", 0))
    if action in ("hold", "return"):
        held = action == "hold"
        if held:
            check_others_serve(upstreams, targets, admin.url)
        for entry in of(upstreams, targets):
            if entry["held"] != held:
                upstreams = admin.set_held(entry["target"], held)
                out["changed"] = True
    elif action == "drained":
        out["drained"], upstreams, out["waited_s"] = wait(
            admin, targets, lambda es: all(e["outstanding"] == 0 for e in es), timeout_s)
    elif action == "in_service":
        out["in_service"], upstreams, out["waited_s"] = wait(
            admin, targets, lambda es: all(e["state"] == "in_service" and not e["held"] for e in es), timeout_s)
    else:
        raise AdminError(f"unknown action {action!r}")
    out["upstreams"] = of(upstreams, targets)
    return out


def main(argv: list[str]) -> int:
    try:
        out = run(json.loads(argv[1]))
    except (AdminError, OSError, KeyError, ValueError) as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    print(json.dumps(out))
    return 1 if out.get("in_service") is False else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
