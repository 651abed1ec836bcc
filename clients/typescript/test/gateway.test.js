// The client against a real gateway and projector: run by scripts/client-tests.sh inside
// scripts/api-stack.sh, which sets PARSLEY_API_URL and the model's names.
import { test } from "node:test";
import assert from "node:assert/strict";
import { ProblemError, Session } from "../src/index.js";

const baseUrl = process.env.PARSLEY_API_URL;
if (!baseUrl) {
  throw new Error(
    "PARSLEY_API_URL is not set: run these tests with scripts/client-tests.sh (it starts a gateway and a projector)",
  );
}
const model = process.env.PARSLEY_API_MODEL ?? "shop";
const orders = process.env.PARSLEY_API_ORDERS ?? "api.orders";
const payments = process.env.PARSLEY_API_PAYMENTS ?? "api.payments";
/** Keys of their own per run: the database outlives runs. */
const unique = (name) => `${name}-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;

test("read your writes: a write, then the session's read returns it", async () => {
  const s = new Session({ baseUrl });
  const key = unique("ryw");
  const ack = await s.write(orders, key, { total: 30, items: ["a"] }, { headers: { source: "client-test" } });
  assert.equal(ack.topic, orders);
  assert.equal(ack.replayed, false);
  assert.ok(ack.partition >= 0 && ack.offset >= 0);
  assert.ok(await s.token());
  const doc = await s.read(model, key);
  assert.deepEqual(doc, { key, document: { total: 30, items: ["a"] }, version: 1 });
  assert.equal(await s.read(model, unique("absent")), null);
  // The model's named query `order` (config/api.toml), gated on the key's owner like the read.
  const other = new Session({ baseUrl });
  await other.write(orders, key, { total: 31 });
  const { rows, truncated } = await other.query(model, "order", { id: key });
  assert.deepEqual(rows, [{ key, doc: { total: 31 }, version: 2 }]);
  assert.equal(truncated, false);
});

test("a batch is written in one transaction and read back merged", async () => {
  const s = new Session({ baseUrl });
  const key = unique("batch");
  const r = await s.writeBatch([
    { topic: orders, key, value: { total: 12 } },
    { topic: payments, key, value: { paid: true }, headers: { source: "web" } },
  ]);
  assert.deepEqual(r.records.map((a) => a.topic), [orders, payments]);
  // Concurrent records: the merge may apply before or after the replace, so wait until both are.
  let doc;
  for (let i = 0; i < 50; i++) {
    doc = await s.read(model, key);
    if (doc && doc.version === 2) break;
    await new Promise((ok) => setTimeout(ok, 100));
  }
  assert.equal(doc.version, 2);
  // Either order is right: the replace last leaves the order alone, the merge last adds the payment.
  assert.equal(doc.document.total, 12);
  assert.ok(doc.document.paid === undefined || doc.document.paid === true, JSON.stringify(doc.document));
  const page = await s.list(model, { limit: 1000 });
  assert.ok(page.documents.some((d) => d.key === key));
});

test("a write retried after a timeout is written once (same idempotency key)", async () => {
  const key = unique("retried");
  let attempts = 0;
  // The first attempt reaches the gateway and is written, but its answer is lost.
  // The session the write starts first (POST /v1/sessions) is answered as usual.
  const lossy = async (url, init) => {
    if (url.endsWith("/v1/sessions")) return fetch(url, init);
    attempts++;
    const response = await fetch(url, init);
    if (attempts === 1) {
      await response.text();
      throw new DOMException("the answer was lost", "TimeoutError");
    }
    return response;
  };
  const s = new Session({ baseUrl, fetch: lossy, backoffMs: 10 });
  const ack = await s.write(orders, key, { n: 1 });
  assert.equal(attempts, 2);
  assert.equal(ack.replayed, true, "the retry is answered from the first acknowledgement");
  const doc = await s.read(model, key);
  assert.equal(doc.version, 1, "one record, not two");
  // Any later retry with that key and body is answered the same coordinate, written nothing.
  const retry = new Session({ baseUrl });
  const sent = [];
  let sentToken;
  const spy = async (url, init) => {
    if (init.headers["Idempotency-Key"]) {
      sent.push(init.headers["Idempotency-Key"]);
      sentToken = init.headers["Parsley-Session"];
    }
    return fetch(url, init);
  };
  const again = await new Session({ baseUrl, fetch: spy, newIdempotencyKey: () => sent[0] ?? "k-" + key }).write(
    orders,
    key,
    { n: 1 },
  );
  assert.equal(again.replayed, false, "a new key writes");
  // A retry with that key and the token it was sent with (keys are scoped by it).
  await retry.storage.set(sentToken);
  const replay = await retry.write(orders, key, { n: 1 }, { idempotencyKey: sent[0] });
  assert.deepEqual([replay.replayed, replay.partition, replay.offset], [true, again.partition, again.offset]);
  assert.equal((await retry.read(model, key)).version, 2);
});

test("problems are typed errors", async () => {
  const s = new Session({ baseUrl });
  const kindOf = (p) =>
    p.then(
      () => assert.fail("expected a ProblemError"),
      (e) => {
        assert.ok(e instanceof ProblemError, String(e));
        return [e.kind, e.status, e.problem];
      },
    );
  const [kind, status, problem] = await kindOf(s.write(orders, "k", { a: "\u0000" }));
  assert.deepEqual([kind, status, problem.field, problem.reason], ["invalid-body", 400, "value.a", "nul"]);
  assert.deepEqual((await kindOf(s.write("no.such.topic", "k", 1))).slice(0, 2), ["unknown-topic", 404]);
  assert.deepEqual((await kindOf(s.read("nope", "k"))).slice(0, 2), ["unknown-model", 404]);
  assert.deepEqual((await kindOf(s.query(model, "nope"))).slice(0, 2), ["unknown-query", 404]);
  assert.deepEqual((await kindOf(s.list(model, { limit: 0 }))).slice(0, 2), ["invalid-query", 400]);
  // A key is scoped by the session token sent: the same token, another body.
  const key = unique("reused");
  const started = await s.token();
  await s.write(orders, key, 1, { idempotencyKey: key });
  await s.storage.set(started);
  assert.deepEqual((await kindOf(s.write(orders, key, 2, { idempotencyKey: key }))).slice(0, 2), [
    "idempotency-key-reused",
    409,
  ]);
  const tampered = new Session({ baseUrl });
  await tampered.storage.set("AQ" + "A".repeat(80));
  const [tk] = await kindOf(tampered.read(model, "k"));
  assert.ok(["token-malformed", "token-invalid"].includes(tk), tk);
});

test("50 concurrent writes on one session: each is read back, none lost from the session", async () => {
  // Every request's tokens sent and token answered, to check that no write's answer is
  // dropped: each must reach the gateway again, alone or in a join.
  const exchanges = [];
  const spy = async (url, init) => {
    const response = await fetch(url, init);
    const sent = (init.headers["Parsley-Session"] ?? "").split(",").map((t) => t.trim()).filter(Boolean);
    exchanges.push({ write: url.includes("/records"), sent, answered: response.headers.get("Parsley-Session") });
    return response;
  };
  const s = new Session({ baseUrl, fetch: spy });
  const base = unique("concurrent");
  const keys = Array.from({ length: 50 }, (_, i) => `${base}-${i}`);
  const acks = await Promise.all(keys.map((key, i) => s.write(orders, key, { n: i })));
  assert.ok(new Set(acks.map((a) => a.partition)).size > 1, "the writes spread over partitions");
  const answered = exchanges.filter((e) => e.write && e.answered).map((e) => e.answered);
  assert.equal(answered.length, 50);
  // Every read carries the session's tokens, joined: each write reads back, however the
  // writes' answers interleaved (a read never waits on another session's writes here).
  const docs = await Promise.all(keys.map((key) => s.read(model, key)));
  docs.forEach((doc, i) => assert.deepEqual(doc, { key: keys[i], document: { n: i }, version: 1 }, keys[i]));
  const resent = new Set(exchanges.filter((e) => !e.write).flatMap((e) => e.sent));
  const lost = answered.filter((t) => !resent.has(t));
  assert.equal(lost.length, 0, `${lost.length} of the 50 writes' tokens never reached the gateway again`);
  // The session's one token now names every write: a second session with only it reads them all.
  const token = await s.join();
  assert.equal(token.includes(","), false);
  const other = new Session({ baseUrl });
  await other.storage.set(token);
  const again = await Promise.all(keys.map((key) => other.read(model, key)));
  again.forEach((doc, i) => assert.deepEqual(doc?.document, { n: i }, keys[i]));
});

test("tokens of concurrent answers sent together are joined by the gateway; bad ones refused by name", async () => {
  const s = new Session({ baseUrl });
  const [a, b] = [unique("ja"), unique("jb")];
  await s.write(orders, a, 1);
  const start = await s.token();
  const one = new Session({ baseUrl });
  const two = new Session({ baseUrl });
  await one.storage.set(start);
  await two.storage.set(start);
  await one.write(orders, b, 2);
  await two.write(orders, `${b}-2`, 3);
  // Both tokens on one request (a comma list): the answer is their join.
  const joined = new Session({ baseUrl });
  await joined.storage.set(`${await one.token()}, ${await two.token()}`);
  assert.equal((await joined.read(model, b)).document, 2);
  assert.equal((await joined.read(model, `${b}-2`)).document, 3);
  assert.equal((await joined.token()).includes(","), false, "one token again");
  // Over the gateway's bound (config/api.toml: 16): the client joins in parts first.
  const many = new Session({ baseUrl, maxSessionTokens: 64 });
  await many.storage.set(Array(20).fill(await one.token()).join(", "));
  assert.equal((await many.read(model, b)).document, 2);
  const garbage = new Session({ baseUrl });
  await garbage.storage.set(`${await one.token()}, AQ`);
  const e = await garbage.read(model, b).catch((x) => x);
  assert.ok(e instanceof ProblemError && e.kind === "token-malformed", String(e));
});
