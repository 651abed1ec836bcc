// Compile-time check of index.d.ts (`npm run typecheck`): typical uses type-check, misuses do not.
import {
  MemoryStorage,
  ProblemError,
  Session,
  WebStorage,
  absorb,
  splitTokens,
  type Document,
  type ProblemKind,
  type TokenStorage,
} from "../src/index.js";

interface Order {
  total: number;
}

export async function uses(): Promise<void> {
  const storage: TokenStorage = new MemoryStorage();
  const session = new Session({ baseUrl: "http://127.0.0.1:8080", storage, retries: 2, headers: () => ({}) });
  const ack = await session.write("orders", "o-1", { total: 3 }, { headers: { source: "web" } });
  const offset: number = ack.offset;
  const replayed: boolean = ack.replayed;
  await session.writeBatch([{ topic: "orders", key: "o-1", value: null }], { idempotencyKey: "k" });
  const doc: Document<Order> | null = await session.read<Order>("shop", "o-1");
  const total: number | undefined = doc?.document.total;
  const page = await session.list("shop", { limit: 10, after: null });
  const next: string | null = page.next;
  try {
    await session.read("shop", "o-2");
  } catch (e) {
    if (e instanceof ProblemError) {
      const kind: ProblemKind = e.kind;
      const status: number = e.status;
      void [kind, status];
    }
  }
  // Tabs sharing localStorage, changes under a Web Lock; several tokens joined.
  const shared: TokenStorage = new WebStorage(localStorage, "orders-session", { locks: navigator.locks });
  const tabs = new Session({ baseUrl: "http://127.0.0.1:8080", storage: shared, maxSessionTokens: 4 });
  const joined: string | null = await tabs.join();
  const held: string[] = splitTokens(await tabs.token());
  const after: string = absorb("a, b", ["a"], "c");
  void [joined, held, after];
  // @ts-expect-error: a value must be JSON
  await session.write("orders", "o-1", () => 1);
  // @ts-expect-error: not a problem kind
  const wrong: ProblemKind = "teapot";
  void [offset, replayed, total, next, wrong];
}
