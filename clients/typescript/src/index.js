// A client for the Parsley gateway (docs/gateway.md, GET /openapi.json).
//
// A `Session` carries the session token (the `Parsley-Session` header): it sends the token it
// holds with every request and keeps the one every answer returns, in a pluggable storage.
// Concurrent requests never lose a write: the storage holds the tokens of answers not yet
// joined (the `Parsley-Session` header value, a comma-separated list), every request sends
// them all, and its answer's token (their join, docs/gateway.md "Several tokens of one
// session") replaces exactly the tokens it sent. Errors are `ProblemError`s carrying the gateway's problem document. 503s (and a 409
// idempotency-key-in-flight) are retried after their `Retry-After`, and requests that did not
// get an answer (a network error, a timeout) after a short backoff, a bounded number of
// times. Every write carries an `Idempotency-Key` (a fresh UUID unless one is given), reused
// across that write's retries, so a retried write is never written twice.
//
// No runtime dependencies: `fetch`, `AbortController` and `crypto.randomUUID` (browsers,
// Node 18+, Deno, Bun). Types: index.d.ts.

/** Prefix of every problem `type`. */
export const PROBLEM_BASE = "https://parsley.dev/problems/";

const SESSION_HEADER = "Parsley-Session";

/** The tokens a held value names (a comma-separated list: the header value). */
export function splitTokens(held) {
  if (!held) return [];
  return held
    .split(",")
    .map((t) => t.trim())
    .filter((t) => t !== "");
}

/**
 * The held value once an answer's token `fresh` came back for a request that sent `sent`:
 * the tokens it sent are gone (the answer joins them), every other token stays (answers of
 * requests still in flight, or of other tabs), and `fresh` is added.
 */
export function absorb(held, sent, fresh) {
  const tokens = splitTokens(held).filter((t) => !sent.includes(t));
  if (!tokens.includes(fresh)) tokens.push(fresh);
  return tokens.join(", ");
}

/** Read-modify-write chains of storages without `update`, per storage object. */
const chains = new WeakMap();

/**
 * Keeps the tokens in a Web Storage (`localStorage`: shared by a browser's tabs of one
 * origin, kept across reloads; `sessionStorage`: one tab's). Every change is a
 * read-modify-write of one entry under the Web Lock named after it (`navigator.locks`), so
 * tabs never overwrite each other's answers; without Web Locks a change is still atomic
 * within the tab (synchronous), and tabs should each keep their own session
 * (`sessionStorage`).
 */
export class WebStorage {
  constructor(storage, key = "parsley-session", options = {}) {
    this.storage = storage;
    this.key = key;
    this.locks = options.locks !== undefined ? options.locks : globalThis.navigator?.locks;
  }
  get() {
    return this.storage.getItem(this.key);
  }
  set(token) {
    if (token === null || token === "") this.storage.removeItem(this.key);
    else this.storage.setItem(this.key, token);
  }
  update(change) {
    const apply = () => this.set(change(this.get()));
    if (!this.locks) return apply();
    return this.locks.request(`parsley-session:${this.key}`, { mode: "exclusive" }, async () => apply());
  }
}

/** Keeps the token in memory: the default storage. */
export class MemoryStorage {
  #token = null;
  get() {
    return this.#token;
  }
  set(token) {
    this.#token = token;
  }
}

/** An answer of the gateway that is a problem document (RFC 9457). */
export class ProblemError extends Error {
  constructor(status, problem, retryAfterMs) {
    const kind =
      typeof problem.type === "string" && problem.type.startsWith(PROBLEM_BASE)
        ? problem.type.slice(PROBLEM_BASE.length)
        : String(problem.type ?? "unknown");
    super(`${status} ${kind}: ${problem.detail ?? problem.title ?? ""}`);
    this.name = "ProblemError";
    /** The HTTP status. */
    this.status = status;
    /** The full `type` URI. */
    this.type = problem.type;
    /** The problem's short name, e.g. `invalid-body`. */
    this.kind = kind;
    this.title = problem.title;
    this.detail = problem.detail;
    /** The whole document, extension members (`field`, `reason`, `gaps`, ...) included. */
    this.problem = problem;
    /** `Retry-After` in milliseconds, when the answer had one. */
    this.retryAfterMs = retryAfterMs;
  }
}

/** No answer at all: every attempt failed on the network or timed out. */
export class NetworkError extends Error {
  constructor(message, cause) {
    super(message, { cause });
    this.name = "NetworkError";
  }
}

/** `Retry-After` (seconds or an HTTP date) in milliseconds, or undefined. */
export function parseRetryAfter(value, now = Date.now()) {
  if (value == null || value === "") return undefined;
  if (/^\d+$/.test(value.trim())) return Number(value.trim()) * 1000;
  const at = Date.parse(value);
  return Number.isNaN(at) ? undefined : Math.max(0, at - now);
}

const sleep = (ms, signal) =>
  new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener(
      "abort",
      () => {
        clearTimeout(timer);
        reject(signal.reason);
      },
      { once: true },
    );
  });

/** Percent-encodes a path segment (a key holding `/` becomes `%2F`). */
const segment = (s) => encodeURIComponent(s);

export class Session {
  constructor(options) {
    if (!options || !options.baseUrl) throw new TypeError("Session: baseUrl is required");
    this.baseUrl = options.baseUrl.replace(/\/+$/, "");
    this.storage = options.storage ?? new MemoryStorage();
    this.fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.retries = options.retries ?? 3;
    this.maxRetryDelayMs = options.maxRetryDelayMs ?? 10_000;
    this.backoffMs = options.backoffMs ?? 200;
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.headers = options.headers ?? {};
    this.bearerToken = options.bearerToken;
    this.newIdempotencyKey = options.newIdempotencyKey ?? (() => globalThis.crypto.randomUUID());
    this.maxSessionTokens = Math.max(2, options.maxSessionTokens ?? 8);
  }

  /**
   * What this session holds (null: none yet): its token, or, while answers of concurrent
   * requests are not yet joined, their tokens as a comma-separated list (sent together).
   */
  async token() {
    return (await this.storage.get()) || null;
  }

  /** Joins every token held into one (`POST /v1/sessions`), as the next request would. */
  async join(options = {}) {
    while (splitTokens(await this.storage.get()).length > 1) await this.#joinHeld(options.signal);
    return this.token();
  }

  /** Forgets the token: the next request starts a new session (after token-expired, say). */
  async reset() {
    await this.#update(() => null);
  }

  /** Writes one record; answers its coordinate. */
  async write(topic, key, value, options = {}) {
    const body = { key, value };
    if (options.headers) body.headers = options.headers;
    const { json, response } = await this.#request("POST", `/v1/topics/${segment(topic)}/records`, {
      body,
      idempotencyKey: options.idempotencyKey ?? this.newIdempotencyKey(),
      signal: options.signal,
    });
    return { ...json, replayed: response.headers.get("Idempotency-Replayed") === "true" };
  }

  /** Writes several records in one Kafka transaction: all or none. */
  async writeBatch(records, options = {}) {
    const { json, response } = await this.#request("POST", "/v1/records", {
      body: { records },
      idempotencyKey: options.idempotencyKey ?? this.newIdempotencyKey(),
      signal: options.signal,
    });
    return { ...json, replayed: response.headers.get("Idempotency-Replayed") === "true" };
  }

  /** Reads one document once the projection reflects this session; null when there is none. */
  async read(model, key, options = {}) {
    try {
      const { json } = await this.#request("GET", `/v1/models/${segment(model)}/documents/${segment(key)}`, {
        signal: options.signal,
      });
      return json;
    } catch (e) {
      if (e instanceof ProblemError && e.kind === "not-found") return null;
      throw e;
    }
  }

  /** Reads a page of documents in key order; pass `next` as `after` for the following page. */
  async list(model, options = {}) {
    const query = new URLSearchParams();
    if (options.limit !== undefined) query.set("limit", String(options.limit));
    if (options.after !== undefined && options.after !== null) query.set("after", options.after);
    const q = query.toString();
    const { json } = await this.#request("GET", `/v1/models/${segment(model)}/documents${q ? `?${q}` : ""}`, {
      signal: options.signal,
    });
    return json;
  }

  /**
   * Runs the model's named query (`[[models.queries]]` in the gateway's configuration) once the
   * projection reflects this session: `{ rows, truncated }`, each row an object by column name.
   * `params` are sent as given (strings, numbers, booleans; JSON parameters as JSON text).
   */
  async query(model, name, params = {}, options = {}) {
    const query = new URLSearchParams();
    for (const [k, v] of Object.entries(params)) query.set(k, String(v));
    const q = query.toString();
    const path = `/v1/models/${segment(model)}/queries/${segment(name)}${q ? `?${q}` : ""}`;
    const { json } = await this.#request("GET", path, { signal: options.signal });
    return json;
  }

  async #headers() {
    const extra = typeof this.headers === "function" ? await this.headers() : this.headers;
    const headers = { ...extra };
    // Asked again before every attempt, so a retry carries a token the application refreshed.
    if (this.bearerToken) {
      const jwt = await this.bearerToken();
      if (jwt) headers["Authorization"] = `Bearer ${jwt}`;
    }
    return headers;
  }

  #joining;
  #starting;

  /** Applies `change` to the held value atomically (the storage's `update`, else in turn). */
  async #update(change) {
    if (typeof this.storage.update === "function") return this.storage.update(change);
    const previous = chains.get(this.storage) ?? Promise.resolve();
    const next = previous.then(async () => this.storage.set(change((await this.storage.get()) ?? null)));
    chains.set(
      this.storage,
      next.catch(() => {}),
    );
    return next;
  }

  /** Joins up to `maxSessionTokens` of the held tokens into one; one join at a time. */
  #joinHeld(signal) {
    this.#joining ??= (async () => {
      try {
        const part = splitTokens(await this.storage.get()).slice(0, this.maxSessionTokens);
        if (part.length > 1) await this.#request("POST", "/v1/sessions", { signal, tokens: part });
      } finally {
        this.#joining = undefined;
      }
    })();
    return this.#joining;
  }

  /** The tokens a request sends: all held, joined first while there are more than the bound. */
  async #sendable(signal) {
    for (;;) {
      const tokens = splitTokens(await this.storage.get());
      if (tokens.length <= this.maxSessionTokens) return tokens;
      await this.#joinHeld(signal);
    }
  }

  /**
   * The tokens an idempotent write carries on every attempt. The gateway scopes a caller's
   * Idempotency-Keys by the tokens it sends (without a subject), so a write without one first
   * starts a session (POST /v1/sessions; concurrent writes share one start): a retry of a
   * first write could not be matched otherwise.
   */
  async #pinnedTokens(signal) {
    const held = await this.#sendable(signal);
    if (held.length > 0) return held;
    this.#starting ??= this.#request("POST", "/v1/sessions", { signal, tokens: [] }).finally(() => {
      this.#starting = undefined;
    });
    await this.#starting;
    return this.#sendable(signal);
  }

  /** One request with its retries; keeps the token of every answer that carries one. */
  async #request(method, path, { body, idempotencyKey, signal, tokens }) {
    const payload = body === undefined ? undefined : JSON.stringify(body);
    // Every attempt of an idempotent write carries the same tokens, so that its key is
    // matched; a join carries the tokens it joins; other requests carry the latest.
    let pinned = tokens ?? (idempotencyKey ? await this.#pinnedTokens(signal) : undefined);
    let lastNetworkError;
    for (let attempt = 0; ; attempt++) {
      const headers = await this.#headers();
      headers["Accept"] = "application/json, application/problem+json";
      if (payload !== undefined) headers["Content-Type"] = "application/json";
      if (idempotencyKey) headers["Idempotency-Key"] = idempotencyKey;
      // The pinned tokens, else the latest: a retry carries what earlier answers handed back.
      const sent = pinned ?? (await this.#sendable(signal));
      if (sent.length > 0) headers[SESSION_HEADER] = sent.join(", ");

      const timeout = new AbortController();
      const timer = setTimeout(() => timeout.abort(new Error(`no answer within ${this.timeoutMs} ms`)), this.timeoutMs);
      const onAbort = () => timeout.abort(signal.reason);
      signal?.addEventListener("abort", onAbort, { once: true });
      let response;
      let text;
      try {
        response = await this.fetch(this.baseUrl + path, { method, headers, body: payload, signal: timeout.signal });
        text = await response.text();
      } catch (e) {
        if (signal?.aborted) throw signal.reason ?? e;
        lastNetworkError = e;
        response = undefined;
      } finally {
        clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
      }

      if (response === undefined) {
        if (attempt >= this.retries) {
          throw new NetworkError(`${method} ${path}: no answer after ${attempt + 1} attempt(s)`, lastNetworkError);
        }
        await sleep(Math.min(this.backoffMs * 2 ** attempt, this.maxRetryDelayMs), signal);
        continue;
      }

      const fresh = response.headers.get(SESSION_HEADER);
      if (fresh) await this.#update((held) => absorb(held, sent, fresh));
      let json;
      try {
        json = text ? JSON.parse(text) : undefined;
      } catch {
        json = undefined;
      }
      if (response.ok) return { json, response };

      const retryAfterMs = parseRetryAfter(response.headers.get("Retry-After"));
      const problem =
        json && typeof json === "object"
          ? json
          : { type: `${PROBLEM_BASE}unknown`, title: response.statusText, status: response.status, detail: text ?? "" };
      const error = new ProblemError(response.status, problem, retryAfterMs);
      // A gateway joining fewer tokens per request than this session sends: send fewer.
      const limit = Number(problem.limit);
      if (error.kind === "too-many-tokens" && tokens === undefined && limit >= 2 && limit < this.maxSessionTokens) {
        this.maxSessionTokens = limit;
        if (pinned !== undefined) pinned = await this.#pinnedTokens(signal);
        continue;
      }
      const retryable = response.status === 503 || (response.status === 409 && error.kind === "idempotency-key-in-flight");
      if (!retryable || attempt >= this.retries) throw error;
      const wait = retryAfterMs ?? this.backoffMs * 2 ** attempt;
      await sleep(Math.min(wait, this.maxRetryDelayMs), signal);
    }
  }
}
