"""``kvsnap chat``: an interactive multi-turn client of a running service (plain HTTP)."""

from __future__ import annotations


def _http(method: str, url: str, key: str, body: dict | None = None):
    import http.client
    import json
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=600)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    conn.request(method, parts.path, body=json.dumps(body) if body is not None else None, headers=headers)
    response = conn.getresponse()
    if response.status >= 400:
        detail = json.loads(response.read() or b"{}").get("error", {}).get("message", response.reason)
        raise SystemExit(f"kvsnap: {response.status}: {detail}")
    return response


def cmd_chat(args) -> int:
    """An interactive multi-turn client against a running service (document from a file)."""
    import json
    import os

    key = args.api_key or os.environ.get("KVSNAP_API_KEY")
    if not key:
        raise SystemExit("kvsnap chat: pass --api-key or set KVSNAP_API_KEY (kvsnap serve prints one)")
    with open(args.document, encoding="utf-8") as fh:
        document = fh.read()
    given = {"policy": args.policy, "budget": args.budget, "window": args.window}
    settings = {k: v for k, v in given.items() if v is not None}  # the rest: the model's defaults
    print(f"prefilling the document ({len(document)} characters)...", flush=True)
    state = json.loads(
        _http("POST", f"{args.url}/v1/sessions", key, {"document": document, "settings": settings}).read()
    )
    sid = state["session_id"]
    print(
        f"session {sid}: {state['logical_len']} tokens seen, {state['kept_len']} kept per full layer "
        f"({state['kv_bytes'] / 2**20:.2f} MiB). Ask away; /state shows the session, /quit ends."
    )
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line in ("/quit", "/exit"):
            return 0
        if line == "/state":
            print(json.loads(_http("GET", f"{args.url}/v1/sessions/{sid}", key).read()))
            continue
        if not line:
            continue
        body = {"message": line, "max_tokens": args.max_tokens, "stream": True}
        response = _http("POST", f"{args.url}/v1/sessions/{sid}/turns", key, body)
        print("kvsnap> ", end="", flush=True)
        for raw in response:
            if not raw.startswith(b"data: "):
                continue
            event = json.loads(raw[6:])
            if "text" in event and "state" not in event:
                print(event["text"], end="", flush=True)
            elif "error" in event:
                print(f"\n[error: {event['error']['message']}]")
            else:
                print(
                    f"\n[{event['prompt_tokens']} new tokens prefilled, KV from {event['source']} on "
                    f"{event['worker']}, {event['state']['kept_len']} rows kept]"
                )
