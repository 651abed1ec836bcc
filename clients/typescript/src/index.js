// A client for the Parsley gateway (docs/gateway.md, GET /openapi.json).
//
// A `Session` carries the session token (the `Parsley-Session` header): it sends the token it
// holds with every request and keeps the one every answer returns, in a pluggable storage.
// Errors are `ProblemError`s carrying the gateway's problem document. 503s (and a 409
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
  }

  /** The token this session holds (null: none yet). */
  async token() {
    return (await this.storage.get()) ?? null;
  }

  /** Forgets the token: the next request starts a new session (after token-expired, say). */
  async reset() {
    await this.storage.set(null);
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

  /** One request with its retries; keeps the token of every answer that carries one. */
  /**
   * The token an idempotent write carries on every attempt. The gateway scopes a caller's
   * Idempotency-Keys by the token it sends (without a subject), so a write without one first
   * starts a session (POST /v1/sessions): a retry of a first write could not be matched
   * otherwise.
   */
  async #pinnedToken(signal) {
    const held = await this.storage.get();
    if (held) return held;
    await this.#request("POST", "/v1/sessions", { signal });
    return (await this.storage.get()) ?? undefined;
  }

  async #request(method, path, { body, idempotencyKey, signal }) {
    const payload = body === undefined ? undefined : JSON.stringify(body);
    // Every attempt of an idempotent write carries the same token, so that its key is
    // matched; other requests carry the latest.
    const pinned = idempotencyKey ? await this.#pinnedToken(signal) : undefined;
    let lastNetworkError;
    for (let attempt = 0; ; attempt++) {
      const headers = await this.#headers();
      headers["Accept"] = "application/json, application/problem+json";
      if (payload !== undefined) headers["Content-Type"] = "application/json";
      if (idempotencyKey) headers["Idempotency-Key"] = idempotencyKey;
      // The pinned token, else the latest: a retry carries what earlier answers handed back.
      const token = pinned ?? (await this.storage.get());
      if (token) headers[SESSION_HEADER] = token;

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
      if (fresh) await this.storage.set(fresh);
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
      const retryable = response.status === 503 || (response.status === 409 && error.kind === "idempotency-key-in-flight");
      if (!retryable || attempt >= this.retries) throw error;
      const wait = retryAfterMs ?? this.backoffMs * 2 ** attempt;
      await sleep(Math.min(wait, this.maxRetryDelayMs), signal);
    }
  }
}
