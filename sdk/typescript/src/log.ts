/**
 * Where the SDK reports what it does: registration, lost leases, drains. Messages are
 * lowercase without a trailing period; data goes in `fields`, not into the text.
 *
 * @module
 */

/** A sink for the SDK's log lines. */
export interface Logger {
  /** Routine progress (registered, draining, stopped). */
  info(message: string, fields?: Record<string, unknown>): void;
  /** Something went wrong and the SDK copes (a failed heartbeat, a lost lease). */
  warn(message: string, fields?: Record<string, unknown>): void;
}

/** Writes `info` and `warn` lines to stderr as `reach-sdk LEVEL message key=value ...`. */
export const stderrLogger: Logger = {
  info: (message, fields) => write("INFO", message, fields),
  warn: (message, fields) => write("WARN", message, fields),
};

/** Discards every line. */
export const silentLogger: Logger = {
  info: () => {},
  warn: () => {},
};

function write(level: string, message: string, fields: Record<string, unknown> = {}): void {
  const pairs = Object.entries(fields).map(
    ([key, value]) => `${key}=${typeof value === "string" ? JSON.stringify(value) : String(value)}`,
  );
  process.stderr.write(
    `${new Date().toISOString()} reach-sdk ${level} ${[message, ...pairs].join(" ")}\n`,
  );
}
