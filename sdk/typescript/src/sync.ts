/**
 * Small concurrency primitives the runtime and client share: a counting semaphore whose
 * waits can be abandoned, an async queue that turns stream events into an async iterable,
 * and an abortable delay.
 *
 * @module
 */

/** A counting semaphore: at most `permits` holders at once, waiters served in order. */
export class Semaphore {
  #free: number;
  readonly #waiting: Array<() => void> = [];

  constructor(permits: number) {
    this.#free = permits;
  }

  /** Takes a permit if one is free now; returns whether it did. */
  tryAcquire(): boolean {
    if (this.#free > 0) {
      this.#free -= 1;
      return true;
    }
    return false;
  }

  /**
   * Takes a permit, waiting for one to be released. Resolves to `false` (taking nothing) when
   * `signal` aborts first.
   */
  acquire(signal: AbortSignal): Promise<boolean> {
    if (this.tryAcquire()) {
      return Promise.resolve(true);
    }
    if (signal.aborted) {
      return Promise.resolve(false);
    }
    return new Promise((resolve) => {
      const granted = () => {
        signal.removeEventListener("abort", abandoned);
        resolve(true);
      };
      const abandoned = () => {
        const index = this.#waiting.indexOf(granted);
        if (index >= 0) {
          this.#waiting.splice(index, 1);
        }
        resolve(false);
      };
      this.#waiting.push(granted);
      signal.addEventListener("abort", abandoned, { once: true });
    });
  }

  /** Gives a permit back, to the longest waiter if there is one. */
  release(): void {
    const next = this.#waiting.shift();
    if (next !== undefined) {
      next();
    } else {
      this.#free += 1;
    }
  }
}

/**
 * Items pushed by event handlers, read as an async iterable (once). `onDrained` runs when
 * the reader has taken every buffered item, so a producer paused at `highWater` can resume.
 */
export class AsyncQueue<T> implements AsyncIterable<T> {
  readonly #items: T[] = [];
  #readers: Array<{ resolve: (r: IteratorResult<T>) => void; reject: (e: unknown) => void }> = [];
  #ended = false;
  #failure: { error: unknown } | undefined;

  constructor(
    readonly highWater: number = Number.POSITIVE_INFINITY,
    private readonly onDrained: () => void = () => {},
  ) {}

  /** How many items wait to be read. */
  get length(): number {
    return this.#items.length;
  }

  /** Adds an item; ignored once the queue ended or failed. */
  push(item: T): void {
    if (this.#ended || this.#failure !== undefined) {
      return;
    }
    const reader = this.#readers.shift();
    if (reader !== undefined) {
      reader.resolve({ value: item, done: false });
    } else {
      this.#items.push(item);
    }
  }

  /** Ends the queue: readers get the buffered items, then the end. */
  end(): void {
    this.#ended = true;
    this.#settleReaders();
  }

  /** Fails the queue: readers get the buffered items, then `error` is thrown to them. */
  fail(error: unknown): void {
    if (this.#ended || this.#failure !== undefined) {
      return;
    }
    this.#failure = { error };
    this.#settleReaders();
  }

  [Symbol.asyncIterator](): AsyncIterator<T> {
    return {
      next: () => {
        if (this.#items.length > 0) {
          const item = this.#items.shift() as T;
          if (this.#items.length === 0) {
            this.onDrained();
          }
          return Promise.resolve({ value: item, done: false });
        }
        if (this.#failure !== undefined) {
          return Promise.reject(this.#failure.error);
        }
        if (this.#ended) {
          return Promise.resolve({ value: undefined, done: true });
        }
        this.onDrained();
        return new Promise((resolve, reject) => this.#readers.push({ resolve, reject }));
      },
    };
  }

  #settleReaders(): void {
    const readers = this.#readers;
    this.#readers = [];
    for (const reader of readers) {
      if (this.#failure !== undefined) {
        reader.reject(this.#failure.error);
      } else {
        reader.resolve({ value: undefined, done: true });
      }
    }
  }
}

/** The longest delay a Node timer takes (about 24.8 days); longer ones would fire at once. */
const MAX_TIMER_MS = 2 ** 31 - 1;

/**
 * `ms` as a timer delay: at least 0, at most {@link MAX_TIMER_MS} (a longer deadline fires
 * that much early, which no caller waits long enough to notice).
 */
export function timerDelay(ms: number): number {
  return Math.min(Math.max(0, ms), MAX_TIMER_MS);
}

/** Resolves after `ms` milliseconds, or at once when `signal` aborts (never rejects). */
export function delay(ms: number, signal?: AbortSignal): Promise<void> {
  if (signal?.aborted) {
    return Promise.resolve();
  }
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, timerDelay(ms));
    signal?.addEventListener("abort", done, { once: true });
  });
}
