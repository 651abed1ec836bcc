#!/usr/bin/env python3
"""The read-your-writes check of `make compose-test`, through a composed gateway (stdlib only).

  session-check.py ready  --gateway URL --admin URL [--timeout S]
      wait until /readyz answers 200 and every task of every model is held by a live lease;
      fails at once, naming it, if a task is refused
  session-check.py write  --gateway URL --state FILE --subject SUB --bearer JWT
      a new session as SUB (the JWT's subject; the composed gateway authenticates callers and
      lets them write and read the key of their own subject): write an order keyed SUB, read
      it back with the returned token, write a payment with that token (merged into the same
      document), read both back; check that a write without the JWT is 401 and one to another
      subject's key 403; keep the token in FILE
  session-check.py resume --gateway URL --state FILE --bearer JWT
      the session of FILE after a restart: the same token still reads its writes, and a new
      write with it is read back too (FILE then holds the session's latest token and write)
  session-check.py status --admin URL
      fail if any task of any model is refused or has no row; print one line per model

A read that answers 503 (not yet covered, or the gateway still starting) is retried until
--timeout (default 90 s); anything else unexpected fails with the answer it got.
"""

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

SESSION = "Parsley-Session"
# The caller's JWT (--bearer), sent with every data request.
BEARER = None


def fail(message):
    print(f"[compose-check] FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def say(message):
    print(f"[compose-check] {message}", flush=True)


def request(method, url, body=None, token=None):
    """One request; returns (status, headers, parsed JSON body or text). Never raises on HTTP."""
    headers = {"accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["content-type"] = "application/json"
    if token is not None:
        headers[SESSION] = token
    if BEARER is not None and ("/v1/models/" in url or "/v1/topics/" in url):
        headers["authorization"] = f"Bearer {BEARER}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as answer:
            status, answer_headers, raw = answer.status, answer.headers, answer.read()
    except urllib.error.HTTPError as error:
        status, answer_headers, raw = error.code, error.headers, error.read()
    text = raw.decode(errors="replace")
    try:
        parsed = json.loads(text) if text else None
    except ValueError:
        parsed = text
    return status, answer_headers, parsed


def retrying(what, timeout, attempt):
    """Calls attempt() until it returns a value that is not None; 503s and refused connections
    (a service still starting) return None from attempt or raise OSError."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            result, last = attempt()
            if result is not None:
                return result
        except OSError as error:
            last = f"connection: {error}"
        if time.monotonic() >= deadline:
            fail(f"{what}: not done within {timeout:.0f} s (last: {last})")
        time.sleep(0.5)


def write(gateway, topic, key, value, token=None):
    url = f"{gateway}/v1/topics/{urllib.parse.quote(topic, safe='')}/records"
    status, headers, body = request("POST", url, {"key": key, "value": value}, token)
    new_token = headers.get(SESSION)
    if status // 100 != 2 or not new_token:
        fail(f"write to {topic} key {key}: {status} {body}")
    return new_token


def read_until(gateway, model, key, token, expect, timeout):
    """Reads the document with the token until it is served (a 503 is retried); the served
    document must hold every field of `expect` with its value: it is the session's write."""
    url = f"{gateway}/v1/models/{model}/documents/{urllib.parse.quote(key, safe='')}"

    def attempt():
        status, headers, body = request("GET", url, token=token)
        if status == 503:
            return None, f"503 {body}"
        if status != 200:
            fail(f"read of {model}/{key} with the session's token: {status} {body}")
        document = body.get("document", body) if isinstance(body, dict) else body
        if not isinstance(document, dict) or any(document.get(k) != v for k, v in expect.items()):
            fail(f"read of {model}/{key} served {body}, which lacks the session's write {expect}")
        return (body, headers.get(SESSION) or token), "200"

    started = time.monotonic()
    body, new_token = retrying(f"read of {model}/{key}", timeout, attempt)
    say(f"read {model}/{key} with the session's token after {time.monotonic() - started:.2f} s: {json.dumps(body)}")
    return new_token


def model_reports(admin):
    status, _, body = request("GET", f"{admin}/v1/status")
    if status != 200 or not isinstance(body, dict):
        return None, f"/v1/status: {status} {body}"
    return body.get("models", []), "200"


def refusals(models):
    found = []
    for model in models:
        for task in model.get("tasks") or []:
            if task.get("status") == "refused" or task.get("refusal"):
                found.append(f"model {model.get('model')} task {task.get('task')}: {json.dumps(task.get('refusal'))}")
    return found


def cmd_ready(args):
    def gateway_ready():
        status, _, body = request("GET", f"{args.gateway}/readyz")
        return (True if status == 200 else None), f"/readyz {status} {body}"

    started = time.monotonic()
    retrying("the gateway's /readyz", args.timeout, gateway_ready)

    def tasks_held():
        models, last = model_reports(args.admin)
        if models is None:
            return None, last
        refused = refusals(models)
        if refused:
            fail("refused task(s): " + "; ".join(refused))
        for model in models:
            tasks = model.get("tasks") or []
            count = model.get("task_count") or 0
            held = sum(1 for t in tasks if (t.get("lease") or {}).get("held"))
            if count == 0 or held < count:
                return None, f"model {model.get('model')}: {held} of {count} tasks held"
        return True, "all held"

    retrying("every task held by the projector", args.timeout, tasks_held)
    say(f"ready after {time.monotonic() - started:.1f} s: /readyz 200, every task held, none refused")


def cmd_status(args):
    models, last = model_reports(args.admin)
    if models is None:
        fail(last)
    refused = refusals(models)
    if refused:
        fail("refused task(s): " + "; ".join(refused))
    for model in models:
        tasks = model.get("tasks") or []
        statuses = sorted({t.get("status") for t in tasks})
        count = model.get("task_count") or 0
        if count == 0 or len(tasks) < count:
            fail(f"model {model.get('model')}: {len(tasks)} task rows of {count}")
        say(f"status: model {model.get('model')}, {len(tasks)} tasks, statuses {statuses}, no refusal")


def cmd_write(args):
    key = args.subject
    global BEARER
    # Refusals first: without the JWT, and to another subject's key.
    saved, BEARER = BEARER, None
    url = f"{args.gateway}/v1/topics/orders/records"
    status, headers, body = request("POST", url, {"key": key, "value": {"item": "teapot"}})
    if status != 401 or "invalid_token" not in (headers.get("www-authenticate") or ""):
        fail(f"a write without a JWT answered {status} {body}, not 401 with a bearer challenge")
    BEARER = saved
    status, _, body = request("POST", url, {"key": f"{key}-someone-else", "value": {"item": "teapot"}})
    if status != 403 or not str(body.get("type", "")).endswith("/forbidden"):
        fail(f"a write to another subject's key answered {status} {body}, not 403 forbidden")
    say("refused as they should be: no JWT (401), another subject's key (403 forbidden)")
    token = write(args.gateway, "orders", key, {"item": "teapot", "total": 30})
    say(f"wrote order {key}; session token {len(token)} characters")
    token = read_until(args.gateway, "shop", key, token, {"item": "teapot"}, args.timeout)
    token = write(args.gateway, "payments", key, {"paid": 30}, token)
    say(f"wrote payment {key} with the token (its cause: the order)")
    expect = {"item": "teapot", "total": 30, "paid": 30}
    token = read_until(args.gateway, "shop", key, token, expect, args.timeout)
    with open(args.state, "w", encoding="utf-8") as state:
        json.dump({"key": key, "token": token, "expect": expect}, state)
    say(f"read-your-writes: the order and the payment read back; session kept in {args.state}")


def cmd_resume(args):
    with open(args.state, encoding="utf-8") as state:
        saved = json.load(state)
    key, token = saved["key"], saved["token"]
    token = read_until(args.gateway, "shop", key, token, saved["expect"], args.timeout)
    token = write(args.gateway, "orders", key, {"item": "teapot", "total": 45}, token)
    say(f"wrote order {key} again with the earlier session's token")
    expect = {"item": "teapot", "total": 45}
    token = read_until(args.gateway, "shop", key, token, expect, args.timeout)
    with open(args.state, "w", encoding="utf-8") as state:
        json.dump({"key": key, "token": token, "expect": expect}, state)
    say("the earlier session still reads its writes, and its new write")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["ready", "write", "resume", "status"])
    parser.add_argument("--gateway", default="http://127.0.0.1:18080")
    parser.add_argument("--admin", default="http://127.0.0.1:19091")
    parser.add_argument("--state")
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--subject", help="the JWT's subject: the key the session writes and reads")
    parser.add_argument("--bearer", help="the caller's JWT (parsley dev-token)")
    args = parser.parse_args()
    global BEARER
    BEARER = args.bearer
    if args.step == "write" and not (args.subject and args.bearer):
        fail("write needs --subject and --bearer")
    if args.step in ("write", "resume") and not args.state:
        fail(f"{args.step} needs --state FILE")
    {"ready": cmd_ready, "write": cmd_write, "resume": cmd_resume, "status": cmd_status}[args.step](args)


if __name__ == "__main__":
    main()
