/**
 * Identifiers on the wire: W3C trace ids and `traceparent` values, and UUIDv7 message ids —
 * the same formats the Rust SDK makes (`reach_rpc::trace`).
 *
 * @module
 */

import { randomBytes } from "node:crypto";

/** The gRPC metadata key of the W3C `traceparent` header. */
export const TRACEPARENT = "traceparent";

const TRACE_ID = /^[0-9a-f]{32}$/;

/**
 * A fresh W3C trace id: 16 random bytes as 32 lowercase hex characters, never all zero
 * (W3C Trace Context reserves all zeros as invalid).
 */
export function newTraceId(): string {
  return nonZeroHex(16);
}

/** A fresh W3C span (parent) id: 8 random bytes as 16 lowercase hex characters, never all zero. */
export function newSpanId(): string {
  return nonZeroHex(8);
}

/** Whether `text` is a valid W3C trace id: 32 lowercase hex characters, not all zero. */
export function isTraceId(text: string): boolean {
  return TRACE_ID.test(text) && !/^0+$/.test(text);
}

/**
 * A `traceparent` value (W3C Trace Context, version 00, sampled) naming a new span of the
 * trace `traceId`: `00-<trace id>-<fresh span id>-01`. The router reads the trace id from it
 * when a message's `header.trace_id` is empty, and traced services parent their spans to it.
 *
 * @throws {RangeError} when `traceId` is not a valid trace id.
 */
export function traceparentFor(traceId: string): string {
  if (!isTraceId(traceId)) {
    throw new RangeError(
      `trace id ${JSON.stringify(traceId)} must be 32 lowercase hex characters, not all zero`,
    );
  }
  return `00-${traceId}-${newSpanId()}-01`;
}

/**
 * A fresh message id: a UUIDv7 (RFC 9562: 48-bit Unix time in ms, then random bits),
 * lowercase and hyphenated, so ids sort by creation time as the Rust SDK's do.
 */
export function newMessageId(): string {
  const bytes = randomBytes(16);
  const ms = Date.now();
  // 48-bit big-endian timestamp: the high 16 bits, then the low 32.
  bytes.writeUInt16BE(Math.floor(ms / 2 ** 32) & 0xffff, 0);
  bytes.writeUInt32BE(ms >>> 0, 2);
  bytes[6] = ((bytes[6] ?? 0) & 0x0f) | 0x70; // version 7
  bytes[8] = ((bytes[8] ?? 0) & 0x3f) | 0x80; // variant 10
  const hex = bytes.toString("hex");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

function nonZeroHex(size: number): string {
  for (;;) {
    const bytes = randomBytes(size);
    if (bytes.some((b) => b !== 0)) {
      return bytes.toString("hex");
    }
  }
}
