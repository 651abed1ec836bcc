// Types of the Parsley gateway client (index.js). The API: docs/gateway.md, GET /openapi.json.

/** Any JSON value: what a record's value and a document are. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/**
 * Where a session keeps its token: the `Parsley-Session` header value, one token or, while
 * answers of concurrent requests are not yet joined, a comma-separated list. May be
 * synchronous or asynchronous.
 */
export interface TokenStorage {
  get(): string | null | undefined | Promise<string | null | undefined>;
  set(token: string | null): void | Promise<void>;
  /**
   * Replaces the held value by `change(held)` atomically: no other change between the read
   * and the write, for every session sharing what this storage keeps (other tabs included).
   * Without it a session changes the storage through `get` and `set` one change at a time,
   * which is atomic only among the sessions of one JavaScript realm using this very object.
   */
  update?(change: (held: string | null) => string | null): void | Promise<void>;
}

/** The Web Locks a `WebStorage` takes (`navigator.locks`). */
export interface LockManagerLike {
  request<T>(name: string, options: { mode: "exclusive" }, callback: () => Promise<T>): Promise<T>;
}

/**
 * Keeps the tokens in a Web Storage entry (`localStorage`: shared by a browser's tabs of one
 * origin; `sessionStorage`: one tab's). Each change is a read-modify-write under the Web Lock
 * `parsley-session:<key>`, so tabs never overwrite each other's answers.
 */
export declare class WebStorage implements TokenStorage {
  /** `locks`: default `navigator.locks`; `null`: none (atomic within the tab only). */
  constructor(
    storage: Pick<Storage, "getItem" | "setItem" | "removeItem">,
    key?: string,
    options?: { locks?: LockManagerLike | null },
  );
  get(): string | null;
  set(token: string | null): void;
  update(change: (held: string | null) => string | null): void | Promise<void>;
}

/** The tokens a held value names (a comma-separated list). */
export declare function splitTokens(held: string | null | undefined): string[];

/**
 * The held value once an answer's token `fresh` came back for a request that sent `sent`: the
 * tokens sent replaced by `fresh`, every other token kept.
 */
export declare function absorb(held: string | null, sent: readonly string[], fresh: string): string;

/** Keeps the token in memory: the default storage. */
export declare class MemoryStorage implements TokenStorage {
  get(): string | null;
  set(token: string | null): void;
}

export interface SessionOptions {
  /** The gateway's main listener, e.g. `https://api.example.com`. */
  baseUrl: string;
  /** Where the token lives (default: memory). */
  storage?: TokenStorage;
  /** The `fetch` to use (default: `globalThis.fetch`). */
  fetch?: typeof fetch;
  /** Retries after a 503, a 409 idempotency-key-in-flight or no answer (default 3). */
  retries?: number;
  /** Longest wait between attempts, whatever `Retry-After` says (default 10000). */
  maxRetryDelayMs?: number;
  /** First backoff after no answer, doubled each time (default 200). */
  backoffMs?: number;
  /** How long one attempt may take (default 30000; the gateway answers within its own
   * response timeout). */
  timeoutMs?: number;
  /** Headers sent with every request, or a function giving them. */
  headers?: Record<string, string> | (() => Record<string, string> | Promise<Record<string, string>>);
  /** Supplies the bearer JWT of the identity provider, asked before every attempt (so a
   * retry carries a refreshed one); sent as `Authorization: Bearer <jwt>`. Null or empty:
   * no Authorization header. Needed when the gateway authenticates callers. */
  bearerToken?: () => string | null | undefined | Promise<string | null | undefined>;
  /** Makes the idempotency key of a write that was given none (default `crypto.randomUUID`). */
  newIdempotencyKey?: () => string;
  /**
   * Most tokens one request sends (default 8, at least 2; at most the gateway's
   * `token_max_per_request`, and lowered to it when the gateway answers `too-many-tokens`).
   * Beyond it the held tokens are joined first (`POST /v1/sessions`).
   */
  maxSessionTokens?: number;
}

export interface WriteOptions {
  /** Application headers of the record (no `parsley.` names). */
  headers?: Record<string, string>;
  /** The write's idempotency key (default: a new UUID, reused across its retries). */
  idempotencyKey?: string;
  signal?: AbortSignal;
}

export interface Acknowledgement {
  topic: string;
  partition: number;
  offset: number;
}

export interface WriteResult extends Acknowledgement {
  /** The gateway answered an earlier identical request's acknowledgement. */
  replayed: boolean;
}

export interface BatchRecord {
  topic: string;
  key: string;
  value: Json;
  headers?: Record<string, string>;
}

export interface BatchResult {
  records: Acknowledgement[];
  replayed: boolean;
}

export interface Document<T = Json> {
  key: string;
  document: T;
  /** Records applied to the document since it was (re)created. */
  version: number;
}

export interface Page<T = Json> {
  documents: Document<T>[];
  /** Pass as `after` for the next page; null on the last. */
  next: string | null;
}

export interface QueryResult<R = Record<string, Json>> {
  rows: R[];
  /** True when the query had more rows than its `max_rows`: only the first are here. */
  truncated: boolean;
}

export interface ListOptions {
  /** 1 to 1000 (default 100). */
  limit?: number;
  after?: string | null;
  signal?: AbortSignal;
}

export declare class Session {
  constructor(options: SessionOptions);
  readonly baseUrl: string;
  readonly storage: TokenStorage;
  /**
   * What this session holds (null: none yet): its token, or the tokens of concurrent answers
   * not yet joined, as a comma-separated list.
   */
  token(): Promise<string | null>;
  /** Joins every token held into one (`POST /v1/sessions`); answers it. */
  join(options?: { signal?: AbortSignal }): Promise<string | null>;
  /** Forgets the token: the next request starts a new session. */
  reset(): Promise<void>;
  write(topic: string, key: string, value: Json, options?: WriteOptions): Promise<WriteResult>;
  writeBatch(records: BatchRecord[], options?: Omit<WriteOptions, "headers">): Promise<BatchResult>;
  /** The document, once the projection reflects this session; null when there is none. */
  read<T = Json>(model: string, key: string, options?: { signal?: AbortSignal }): Promise<Document<T> | null>;
  list<T = Json>(model: string, options?: ListOptions): Promise<Page<T>>;
  /** A named query's rows, once the projection reflects this session. */
  query<R = Record<string, Json>>(
    model: string,
    name: string,
    params?: Record<string, string | number | boolean>,
    options?: { signal?: AbortSignal },
  ): Promise<QueryResult<R>>;
}

/** Every problem the gateway answers with (the last segment of its `type`). */
export type ProblemKind =
  | "token-malformed"
  | "token-invalid"
  | "token-expired"
  | "token-too-old"
  | "token-wrong-subject"
  | "token-subjects-differ"
  | "too-many-tokens"
  | "token-ahead-of-log"
  | "invalid-subject"
  | "unauthenticated"
  | "forbidden"
  | "session-too-large"
  | "metadata-budget-exceeded"
  | "reserved-header"
  | "invalid-body"
  | "value-invalid"
  | "body-too-large"
  | "body-timeout"
  | "invalid-query"
  | "invalid-key"
  | "invalid-path"
  | "width-changed"
  | "invalid-idempotency-key"
  | "idempotency-key-reused"
  | "idempotency-key-in-flight"
  | "idempotency-outcome-unknown"
  | "cors-origin-not-allowed"
  | "unauthorized"
  | "unknown-topic"
  | "unknown-model"
  | "unknown-query"
  | "query-failed"
  | "query-timeout"
  | "query-result-too-large"
  | "not-found"
  | "no-such-route"
  | "not-yet-covered"
  | "write-failed"
  | "unavailable"
  | "overloaded"
  | "request-timeout"
  | "not-ready"
  | "internal";

/** value-invalid: one way a written value breaks its topic's data contract (JSON Schema). */
export interface ValueError {
  /** RFC 6901 JSON pointer into the value ("" for the value itself). */
  pointer: string;
  /** The schema keyword that failed (`type`, `required`, `minimum`, ...). */
  keyword: string;
  /** JSON pointer into the topic's schema. */
  schema_path: string;
  message: string;
  /** Batch writes: the record's index in `records`. */
  record?: number;
  /** Batch writes: the record's topic. */
  topic?: string;
}

/** A problem document (RFC 9457) with the gateway's extension members. */
export interface Problem {
  type: string;
  title: string;
  status: number;
  detail: string;
  /** invalid-body: the part of the body at fault. */
  field?: string;
  /** invalid-body: why. */
  reason?: "shape" | "nul" | "duplicate-key" | "empty" | "too-long" | "too-deep" | "unrepresentable";
  /** value-invalid: how the value breaks its topic's schema (at most 10). */
  errors?: ValueError[];
  /** invalid-query, invalid-key. */
  parameter?: string;
  topic?: string;
  model?: string;
  /** too-many-tokens: the most tokens a request may carry. */
  limit?: number;
  [extension: string]: unknown;
}

/** An answer that is a problem document. */
export declare class ProblemError extends Error {
  readonly status: number;
  readonly type: string;
  readonly kind: ProblemKind;
  readonly title: string;
  readonly detail: string;
  readonly problem: Problem;
  /** `Retry-After` in milliseconds, when the answer had one. */
  readonly retryAfterMs: number | undefined;
}

/** No answer at all: every attempt failed on the network or timed out. */
export declare class NetworkError extends Error {}

export declare const PROBLEM_BASE: "https://parsley.dev/problems/";

/** `Retry-After` (seconds or an HTTP date) in milliseconds. */
export declare function parseRetryAfter(value: string | null | undefined, now?: number): number | undefined;
