/**
 * Duplicate suppression: a bounded, time-windowed memory of handled message ids (the Rust
 * SDK's `dedupe` module). A message redelivered — a retry after a lost reply, a replayed
 * orchestrator step — gets the outcome of its first delivery instead of running the handler
 * again; a duplicate that arrives while the first is still running waits for it.
 *
 * @module
 */

/** The outcome slot of one message id. */
export interface Slot<T> {
  /** The remembered outcome, once a run produced one. */
  outcome?: T;
  /** The run in progress, if any: duplicates wait for it. */
  running?: Promise<T | undefined>;
}

interface Entry<T> {
  slot: Slot<T>;
  /** When the id was first seen (ms since the epoch). */
  at: number;
  /** The bytes charged to this id. */
  bytes: number;
}

/**
 * Remembers outcomes by message id for `windowMs`, holding at most `capacity` ids and at most
 * `maxBytes` of charged outcomes, the oldest forgotten first.
 */
export class DedupeCache<T> {
  /** Insertion-ordered: the first entry is the oldest. */
  readonly #entries = new Map<string, Entry<T>>();
  #bytes = 0;

  constructor(
    readonly windowMs: number,
    readonly capacity: number,
    readonly maxBytes: number,
    private readonly now: () => number = Date.now,
  ) {}

  /** How many ids are remembered. */
  get size(): number {
    return this.#entries.size;
  }

  /** The bytes charged to the remembered ids. */
  get bytes(): number {
    return this.#bytes;
  }

  /**
   * Runs `run` for `messageId` once: the first caller runs it, callers of the same id while it
   * runs wait for its outcome, and later ones (within the window) get the remembered outcome.
   * `run` resolves to `undefined` when the message was not handled (it never got a handler
   * slot): nothing is remembered, and the next caller of the id runs its own `run`.
   * `sizeOf` is what remembering an outcome costs, in bytes (see {@link DedupeCache.maxBytes}).
   */
  async once(
    messageId: string,
    run: () => Promise<T | undefined>,
    sizeOf: (outcome: T) => number,
  ): Promise<T | undefined> {
    for (;;) {
      const slot = this.#slot(messageId);
      if (slot.outcome !== undefined) {
        return slot.outcome;
      }
      if (slot.running !== undefined) {
        const outcome = await slot.running;
        if (outcome !== undefined) {
          return outcome;
        }
        // The first run did not handle it: try with this caller's own run.
        continue;
      }
      const running = run();
      slot.running = running;
      let outcome: T | undefined;
      try {
        outcome = await running;
      } finally {
        delete slot.running;
      }
      if (outcome !== undefined) {
        slot.outcome = outcome;
        this.#charge(messageId, sizeOf(outcome));
      }
      return outcome;
    }
  }

  /** The slot of `messageId`, created empty the first time within the window. */
  #slot(messageId: string): Slot<T> {
    const now = this.now();
    for (const [id, entry] of this.#entries) {
      if (now - entry.at < this.windowMs && this.#entries.size < this.capacity) {
        break;
      }
      this.#forget(id, entry);
    }
    const found = this.#entries.get(messageId);
    if (found !== undefined) {
      return found.slot;
    }
    const slot: Slot<T> = {};
    this.#entries.set(messageId, { slot, at: now, bytes: 0 });
    return slot;
  }

  /**
   * Charges `bytes` to `messageId`, then forgets the oldest ids until the charged total is
   * within `maxBytes` again — possibly `messageId` itself, when its outcome alone is larger.
   */
  #charge(messageId: string, bytes: number): void {
    const entry = this.#entries.get(messageId);
    if (entry === undefined) {
      return;
    }
    entry.bytes += bytes;
    this.#bytes += bytes;
    for (const [id, oldest] of this.#entries) {
      if (this.#bytes <= this.maxBytes) {
        break;
      }
      this.#forget(id, oldest);
    }
  }

  #forget(id: string, entry: Entry<T>): void {
    this.#entries.delete(id);
    this.#bytes -= entry.bytes;
  }
}
