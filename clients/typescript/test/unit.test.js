// The client's behaviour against a scripted fetch: no gateway needed.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import {
  MemoryStorage,
  NetworkError,
  PROBLEM_BASE,
  ProblemError,
  Session,
  WebStorage,
  absorb,
  parseRetryAfter,
  splitTokens,
} from "../src/index.js";

/**
 * A fetch answering from `script` in turn, recording each request. `POST /v1/sessions` (a
 * write's session started first) is answered apart, with the token "t0", and recorded in
 * `sessions`.
 */
function scripted(script) {
  const calls = [];
  const sessions = [];
  const fetch = async (url, init) => {
    if (url.endsWith("/v1/sessions")) {
      sessions.push({ url, method: init.method, headers: { ...init.headers } });
      return new Response(JSON.stringify({ expires_at: 1 }), { status: 200, headers: { "Parsley-Session": "t0" } });
    }
    calls.push({ url, method: init.method, headers: { ...init.headers }, body: init.body });
    const step = script[Math.min(calls.length - 1, script.length - 1)];
    if (step instanceof Error) throw step;
    return new Response(step.body === undefined ? null : JSON.stringify(step.body), {
      status: step.status,
      headers: step.headers ?? {},
    });
  };
  return { fetch, calls, sessions };
}

const ack = { status: 201, body: { topic: "orders", partition: 1, offset: 7 }, headers: { "Parsley-Session": "t1" } };
const problem = (kind, status, headers = {}, extra = {}) => ({
  status,
  body: { type: PROBLEM_BASE + kind, title: kind, status, detail: `a ${kind}`, ...extra },
  headers: { "Content-Type": "application/problem+json", ...headers },
});

test("the token of every answer is kept and sent with the next request", async () => {
  const { fetch, calls } = scripted([ack, { status: 200, body: { key: "k", document: 1, version: 1 }, headers: { "Parsley-Session": "t2" } }]);
  const s = new Session({ baseUrl: "http://gw/", fetch });
  assert.equal(await s.token(), null);
  await s.write("orders", "k", { a: 1 });
  assert.equal(await s.token(), "t1");
  await s.read("shop", "k");
  assert.equal(calls[0].headers["Parsley-Session"], "t0", "the write's session was started first");
  assert.equal(calls[1].headers["Parsley-Session"], "t1");
  assert.equal(calls[1].url, "http://gw/v1/models/shop/documents/k");
  assert.equal(await s.token(), "t2");
  await s.reset();
  assert.equal(await s.token(), null);
});

test("a first write starts a session, and every attempt of a write carries the same token", async () => {
  const { fetch, calls, sessions } = scripted([
    { ...problem("write-failed", 503, { "Retry-After": "0" }), headers: { "Parsley-Session": "t-other", "Retry-After": "0" } },
    ack,
  ]);
  const s = new Session({ baseUrl: "http://gw", fetch });
  await s.write("orders", "k", 1);
  assert.equal(sessions.length, 1);
  assert.equal(sessions[0].method, "POST");
  assert.deepEqual(
    calls.map((c) => c.headers["Parsley-Session"]),
    ["t0", "t0"],
    "the retry carries the token its key is scoped by, not one a refusal handed back",
  );
  // The refusal's token answered an attempt that sent t0, and so did the acknowledgement:
  // neither is known to hold the other, so both are kept and sent together.
  assert.equal(await s.token(), "t-other, t1");
  await s.write("orders", "k", 2);
  assert.equal(sessions.length, 1, "a session held is not started again");
  assert.equal(calls[2].headers["Parsley-Session"], "t-other, t1");
  assert.equal(await s.token(), "t1", "the answer's token replaces the tokens sent");
});

test("the bearer token is asked for before every attempt", async () => {
  const { fetch, calls, sessions } = scripted([problem("unavailable", 503, { "Retry-After": "0" }), ack]);
  let n = 0;
  const s = new Session({ baseUrl: "http://gw", fetch, bearerToken: async () => `jwt-${++n}` });
  await s.write("orders", "k", 1);
  assert.equal(sessions[0].headers["Authorization"], "Bearer jwt-1", "the session is started as the caller");
  assert.equal(calls[0].headers["Authorization"], "Bearer jwt-2");
  assert.equal(calls[1].headers["Authorization"], "Bearer jwt-3", "a retry carries the token supplied then");
  const without = scripted([ack]);
  await new Session({ baseUrl: "http://gw", fetch: without.fetch, bearerToken: () => null }).write("orders", "k", 1);
  assert.equal(without.calls[0].headers["Authorization"], undefined);
});

test("a refusal by the rules is a typed problem, not retried", async () => {
  const { fetch, calls } = scripted([problem("forbidden", 403, {}, { rules: ["own-orders"] })]);
  const s = new Session({ baseUrl: "http://gw", fetch, bearerToken: () => "jwt" });
  const error = await s.write("orders", "bob", 1).catch((e) => e);
  assert.ok(error instanceof ProblemError);
  assert.equal(error.kind, "forbidden");
  assert.deepEqual(error.problem.rules, ["own-orders"]);
  assert.equal(calls.length, 1);
});

test("storage is pluggable, synchronous or not", async () => {
  const saved = [];
  const storage = { get: async () => saved.at(-1) ?? "from-storage", set: async (t) => void saved.push(t) };
  const { fetch, calls } = scripted([ack]);
  await new Session({ baseUrl: "http://gw", fetch, storage }).write("orders", "k", 1);
  assert.equal(calls[0].headers["Parsley-Session"], "from-storage");
  assert.deepEqual(saved, ["t1"]);
  const memory = new MemoryStorage();
  memory.set("x");
  assert.equal(memory.get(), "x");
});

test("a 503 is retried after its Retry-After with the same idempotency key", async () => {
  const { fetch, calls } = scripted([problem("write-failed", 503, { "Retry-After": "0" }), ack]);
  const s = new Session({ baseUrl: "http://gw", fetch });
  const r = await s.write("orders", "k", 1, { headers: { h: "v" } });
  assert.deepEqual(r, { topic: "orders", partition: 1, offset: 7, replayed: false });
  assert.equal(calls.length, 2);
  const key = calls[0].headers["Idempotency-Key"];
  assert.match(key, /^[0-9a-f-]{36}$/);
  assert.equal(calls[1].headers["Idempotency-Key"], key);
  assert.deepEqual(JSON.parse(calls[0].body), { key: "k", value: 1, headers: { h: "v" } });
});

test("no answer is retried with backoff, then a NetworkError", async () => {
  const { fetch, calls } = scripted([new TypeError("fetch failed"), new TypeError("fetch failed"), ack]);
  const s = new Session({ baseUrl: "http://gw", fetch, backoffMs: 1 });
  assert.equal((await s.write("orders", "k", 1)).offset, 7);
  assert.equal(new Set(calls.map((c) => c.headers["Idempotency-Key"])).size, 1);
  const failing = scripted([new TypeError("fetch failed")]);
  const t = new Session({ baseUrl: "http://gw", fetch: failing.fetch, retries: 2, backoffMs: 1 });
  await assert.rejects(t.read("shop", "k"), NetworkError);
  assert.equal(failing.calls.length, 3);
});

test("retries are bounded and the last problem is thrown", async () => {
  const { fetch, calls } = scripted([problem("not-yet-covered", 503, { "Retry-After": "0" }, { gaps: [] })]);
  const s = new Session({ baseUrl: "http://gw", fetch, retries: 2 });
  const e = await s.read("shop", "k").catch((e) => e);
  assert.ok(e instanceof ProblemError);
  assert.equal(e.kind, "not-yet-covered");
  assert.equal(e.status, 503);
  assert.equal(e.retryAfterMs, 0);
  assert.deepEqual(e.problem.gaps, []);
  assert.equal(calls.length, 3);
});

test("client errors are thrown at once, typed", async () => {
  const { fetch, calls } = scripted([problem("invalid-body", 400, {}, { field: "value", reason: "nul" })]);
  const s = new Session({ baseUrl: "http://gw", fetch });
  const e = await s.write("orders", "k", 1).catch((e) => e);
  assert.ok(e instanceof ProblemError);
  assert.deepEqual([e.kind, e.status, e.problem.field, e.problem.reason], ["invalid-body", 400, "value", "nul"]);
  assert.equal(calls.length, 1);
});

test("a missing document is null, with the refreshed token kept", async () => {
  const { fetch } = scripted([problem("not-found", 404, { "Parsley-Session": "t9" }, { key: "k" })]);
  const s = new Session({ baseUrl: "http://gw", fetch });
  assert.equal(await s.read("shop", "k"), null);
  assert.equal(await s.token(), "t9");
});

test("a named query's parameters are percent-encoded, its rows returned", async () => {
  const rows = { rows: [{ customer: "ada b", due: 7.5 }], truncated: false };
  const { fetch, calls } = scripted([{ status: 200, body: rows, headers: { "Parsley-Session": "t2" } }]);
  const s = new Session({ baseUrl: "http://gw", fetch });
  assert.deepEqual(await s.query("totals", "customer_total", { customer: "ada b", min: 2 }), rows);
  assert.equal(calls[0].url, "http://gw/v1/models/totals/queries/customer_total?customer=ada+b&min=2");
  assert.equal(await s.token(), "t2");
});

test("keys and cursors are percent-encoded", async () => {
  const { fetch, calls } = scripted([{ status: 200, body: { documents: [], next: null } }]);
  const s = new Session({ baseUrl: "http://gw", fetch });
  await s.list("shop", { limit: 5, after: "a/b c" });
  assert.equal(calls[0].url, "http://gw/v1/models/shop/documents?limit=5&after=a%2Fb+c");
  const one = scripted([{ status: 200, body: { key: "a/b", document: 1, version: 1 } }]);
  await new Session({ baseUrl: "http://gw", fetch: one.fetch }).read("shop", "a/b");
  assert.equal(one.calls[0].url, "http://gw/v1/models/shop/documents/a%2Fb");
});

test("Retry-After is read in seconds or as a date", () => {
  assert.equal(parseRetryAfter("3"), 3000);
  assert.equal(parseRetryAfter(null), undefined);
  assert.equal(parseRetryAfter(new Date(10_000).toUTCString(), 4_000), 6_000);
});

test("the declared problem kinds are the gateway's (gateway/openapi.json)", () => {
  const doc = JSON.parse(readFileSync(new URL("../../../gateway/openapi.json", import.meta.url), "utf8"));
  const documented = Object.entries(doc.components.schemas)
    .filter(([name]) => /^Problem\d+$/.test(name))
    .flatMap(([, s]) => s.allOf[1].properties.type.enum.map((uri) => uri.slice(PROBLEM_BASE.length)))
    .sort();
  const dts = readFileSync(new URL("../src/index.d.ts", import.meta.url), "utf8");
  const union = dts.split("export type ProblemKind =")[1].split(";")[0];
  const declared = [...union.matchAll(/"([a-z-]+)"/g)].map((m) => m[1]).sort();
  assert.deepEqual(declared, documented);
});

/** A response after `ms`, carrying token `token`. */
const later = (ms, status, body, token) =>
  new Promise((ok) =>
    setTimeout(() => ok(new Response(JSON.stringify(body), { status, headers: { "Parsley-Session": token } })), ms),
  );

test("concurrent answers' tokens are all kept, sent together, and replaced by their join", async () => {
  const sent = [];
  let n = 0;
  const fetch = async (url, init) => {
    sent.push([url.replace("http://gw", ""), init.headers["Parsley-Session"]]);
    if (url.endsWith("/v1/sessions")) {
      const joined = splitTokens(init.headers["Parsley-Session"]).join("+");
      return later(0, 200, { expires_at: 1 }, joined ? `j(${joined})` : "t0");
    }
    if (init.method === "POST") {
      const i = ++n;
      // The first write is answered last.
      return later(i === 1 ? 30 : 5, 201, { topic: "orders", partition: i, offset: i }, `w${i}`);
    }
    return later(0, 200, { key: "k", document: 1, version: 1 }, "r");
  };
  const s = new Session({ baseUrl: "http://gw", fetch, maxSessionTokens: 3 });
  await Promise.all([s.write("orders", "a", 1), s.write("orders", "b", 2), s.write("orders", "c", 3)]);
  assert.deepEqual(
    sent.filter(([p]) => p.startsWith("/v1/topics")).map(([, t]) => t),
    ["t0", "t0", "t0"],
    "one session started for the three writes",
  );
  assert.deepEqual(splitTokens(await s.token()).sort(), ["w1", "w2", "w3"], "no answer lost, whatever the order");
  await s.read("shop", "k");
  assert.equal(sent.at(-1)[1], "w2, w3, w1", "all sent at once, in the order they came");
  assert.equal(await s.token(), "r");

  // More than maxSessionTokens held: joined first by POST /v1/sessions, in parts.
  await s.storage.set("a1, a2, a3, a4, a5");
  await s.read("shop", "k");
  const joins = sent.filter(([p]) => p === "/v1/sessions").slice(1);
  assert.deepEqual(joins.map(([, t]) => t), ["a1, a2, a3"]);
  assert.equal(sent.at(-1)[1], "a4, a5, j(a1+a2+a3)");
  assert.equal(await s.token(), "r");
  await s.storage.set("x, y");
  assert.equal(await s.join(), "j(x+y)");
});

test("a gateway joining fewer tokens per request lowers the session's bound", async () => {
  const sent = [];
  const fetch = async (url, init) => {
    const tokens = splitTokens(init.headers["Parsley-Session"]);
    sent.push(tokens.length);
    if (tokens.length > 2) {
      const body = { type: PROBLEM_BASE + "too-many-tokens", title: "t", status: 400, detail: "d", limit: 2 };
      return new Response(JSON.stringify(body), { status: 400 });
    }
    return later(0, 200, { key: "k", document: 1, version: 1 }, url.endsWith("/v1/sessions") ? "j" : "r");
  };
  const s = new Session({ baseUrl: "http://gw", fetch });
  await s.storage.set("a, b, c");
  await s.read("shop", "k");
  assert.equal(s.maxSessionTokens, 2);
  assert.deepEqual(sent, [3, 2, 2], "refused, then a join of two, then the read with two");
  assert.equal(await s.token(), "r");
});

test("absorb replaces exactly the tokens a request sent", () => {
  assert.equal(absorb(null, [], "t"), "t");
  assert.equal(absorb("a, b, c", ["a", "c"], "d"), "b, d");
  assert.equal(absorb("b", ["a"], "d"), "b, d", "a token absorbed meanwhile stays gone, the other stays");
  assert.equal(absorb("d", ["a"], "d"), "d");
  assert.deepEqual(splitTokens(" a ,b,, c "), ["a", "b", "c"]);
});

test("WebStorage changes its entry under a Web Lock; tabs sharing it lose no answer", async () => {
  const entries = new Map();
  const local = {
    getItem: (k) => entries.get(k) ?? null,
    setItem: (k, v) => void entries.set(k, String(v)),
    removeItem: (k) => void entries.delete(k),
  };
  // A lock manager that runs callbacks one at a time, in order, like navigator.locks.
  const taken = [];
  let queue = Promise.resolve();
  const locks = {
    request: (name, options, callback) => {
      taken.push([name, options.mode]);
      const run = queue.then(() => callback());
      queue = run.catch(() => {});
      return run;
    },
  };
  // Two "tabs": two sessions over two WebStorage objects of one entry.
  const answers = [];
  const fetch = async (url, init) => {
    const i = answers.length;
    answers.push(init.headers["Parsley-Session"]);
    return later(10 - i, 201, { topic: "orders", partition: 0, offset: i }, `w${i}`);
  };
  const tab = () => new Session({ baseUrl: "http://gw", fetch, storage: new WebStorage(local, "s", { locks }) });
  local.setItem("s", "t0");
  await Promise.all([tab().write("orders", "a", 1), tab().write("orders", "b", 2), tab().write("orders", "c", 3)]);
  assert.deepEqual(splitTokens(local.getItem("s")).sort(), ["w0", "w1", "w2"]);
  assert.ok(taken.every(([name, mode]) => name === "parsley-session:s" && mode === "exclusive"));
  await tab().reset();
  assert.equal(local.getItem("s"), null);
  // Without Web Locks: the change is one synchronous read-modify-write.
  const plain = new WebStorage(local, "p", { locks: null });
  plain.update(() => "x");
  assert.equal(plain.get(), "x");
});
