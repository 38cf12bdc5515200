/**
 * Errors as Reach sends them: a gRPC status code, a message a person can act on, and a
 * `google.rpc.ErrorInfo` (domain `reach.dev`) whose reason a program branches on, with a
 * `google.rpc.RetryInfo` when the caller should come back later and a `google.rpc.BadRequest`
 * naming refused fields. `docs/errors.md` lists every reason.
 *
 * @module
 */

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { anyPack, anyUnpack, durationFromMs, durationMs } from "@bufbuild/protobuf/wkt";
import { Metadata, status as Code, type StatusObject } from "@grpc/grpc-js";

import {
  BadRequestSchema,
  ErrorInfoSchema,
  RetryInfoSchema,
} from "./gen/google/rpc/error_details_pb.js";
import { StatusSchema } from "./gen/google/rpc/status_pb.js";

export { Code };

/** The ErrorInfo domain of every Reach error. */
export const ERROR_DOMAIN = "reach.dev";

/** The metadata key of the encoded `google.rpc.Status` that carries error details. */
export const STATUS_DETAILS_KEY = "grpc-status-details-bin";

/**
 * The ErrorInfo reasons Reach services and SDKs send (the constants of
 * `reach_rpc::errors::reason`; `docs/errors.md` says what each means and what to do).
 * Compare {@link ReachError.reason} with these, never the message text.
 */
export const Reason = {
  NOT_AUTHORIZED: "NOT_AUTHORIZED",
  UNAUTHENTICATED: "UNAUTHENTICATED",
  ROUTE_NOT_FOUND: "ROUTE_NOT_FOUND",
  PAYLOAD_TOO_LARGE: "PAYLOAD_TOO_LARGE",
  INVALID_TRACE_ID: "INVALID_TRACE_ID",
  INVALID_TARGET: "INVALID_TARGET",
  DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
  INSTANCE_DRAINING: "INSTANCE_DRAINING",
  CAPABILITY_NOT_HANDLED: "CAPABILITY_NOT_HANDLED",
  LEASE_NOT_FOUND: "LEASE_NOT_FOUND",
  INSTANCE_DRAINED: "INSTANCE_DRAINED",
  INSTANCE_UNAVAILABLE: "INSTANCE_UNAVAILABLE",
  INSTANCE_LOST: "INSTANCE_LOST",
  REPLY_PEER_UNAVAILABLE: "REPLY_PEER_UNAVAILABLE",
  OVERLOADED: "OVERLOADED",
  MESSAGE_EXPIRED: "MESSAGE_EXPIRED",
  VERSION_NOT_SUPPORTED: "VERSION_NOT_SUPPORTED",
  INVALID_PAYLOAD: "INVALID_PAYLOAD",
  CAPABILITY_NOT_DECLARED: "CAPABILITY_NOT_DECLARED",
  TOO_MANY_WATCHES: "TOO_MANY_WATCHES",
  PROBE_RATE_LIMITED: "PROBE_RATE_LIMITED",
  CALL_ID_IN_USE: "CALL_ID_IN_USE",
  INVALID_FRAME: "INVALID_FRAME",
  INVALID_HEADER: "INVALID_HEADER",
  TURN_LIMIT_EXCEEDED: "TURN_LIMIT_EXCEEDED",
  ADAPTER_FAILED: "ADAPTER_FAILED",
  MODEL_RATE_LIMITED: "MODEL_RATE_LIMITED",
  MODEL_TIMEOUT: "MODEL_TIMEOUT",
  MODEL_BAD_RESPONSE: "MODEL_BAD_RESPONSE",
  MODEL_UNAVAILABLE: "MODEL_UNAVAILABLE",
  MODEL_REFUSED: "MODEL_REFUSED",
  TASK_NOT_FOUND: "TASK_NOT_FOUND",
  INVALID_TASK_ID: "INVALID_TASK_ID",
  INVALID_LABELS: "INVALID_LABELS",
  TASK_ID_IN_USE: "TASK_ID_IN_USE",
  TASK_NOT_WAITING: "TASK_NOT_WAITING",
  NODE_NOT_WAITING: "NODE_NOT_WAITING",
  INVALID_INPUT: "INVALID_INPUT",
  TASK_ENDED: "TASK_ENDED",
  TASK_NOT_RETRYABLE: "TASK_NOT_RETRYABLE",
  TASK_CONTENDED: "TASK_CONTENDED",
  FLOW_NOT_FOUND: "FLOW_NOT_FOUND",
  FLOW_NOT_LOADED: "FLOW_NOT_LOADED",
  INVALID_FLOW: "INVALID_FLOW",
  FLOW_VERSION_CONFLICT: "FLOW_VERSION_CONFLICT",
  INVALID_PAGE_TOKEN: "INVALID_PAGE_TOKEN",
  STORE_UNAVAILABLE: "STORE_UNAVAILABLE",
  STORE_CONFLICT: "STORE_CONFLICT",
  STORE_CORRUPT: "STORE_CORRUPT",
  INVALID_WEBHOOK: "INVALID_WEBHOOK",
  TOO_MANY_WEBHOOKS: "TOO_MANY_WEBHOOKS",
  WEBHOOK_NOT_FOUND: "WEBHOOK_NOT_FOUND",
} as const;

/** One of the {@link Reason} strings. */
export type ReasonName = (typeof Reason)[keyof typeof Reason];

/** A field a request was refused for (`google.rpc.BadRequest.FieldViolation`). */
export interface FieldViolation {
  /** The field's path (for example `instance.capabilities[0].input_schema`, `input/category`). */
  readonly field: string;
  /** What is wrong with it. */
  readonly description: string;
}

/** What a {@link ReachError} carries besides its code and message. */
export interface ReachErrorDetails {
  /** The ErrorInfo reason (a {@link Reason}); absent when the status carried no ErrorInfo. */
  readonly reason?: string | undefined;
  /** The ErrorInfo domain (`reach.dev` for Reach's own reasons). */
  readonly domain?: string | undefined;
  /** The ErrorInfo metadata; the keys each reason carries are listed in `docs/errors.md`. */
  readonly metadata?: Readonly<Record<string, string>> | undefined;
  /** The RetryInfo delay, in milliseconds: when to try again. */
  readonly retryAfterMs?: number | undefined;
  /** The BadRequest field violations. */
  readonly violations?: readonly FieldViolation[] | undefined;
}

/**
 * A failed call: the gRPC status of the router, an agent's handler, the registry or the
 * orchestrator, with its ErrorInfo reason, metadata and retry hint decoded.
 *
 * An agent's handler throws one to answer with that status (see {@link ReachError.of}).
 */
export class ReachError extends Error {
  /** The gRPC status code (`Code.NOT_FOUND`, ...). */
  readonly code: Code;
  /** The status message as the peer sent it (lowercase, says what to fix). */
  readonly statusMessage: string;
  /** The ErrorInfo reason (a {@link Reason}); `undefined` when the status carried none. */
  readonly reason: string | undefined;
  /** The ErrorInfo domain (`reach.dev`); `undefined` when the status carried no ErrorInfo. */
  readonly domain: string | undefined;
  /** The ErrorInfo metadata (empty when there is none). */
  readonly metadata: Readonly<Record<string, string>>;
  /** The RetryInfo delay in milliseconds; `undefined` when the status carried none. */
  readonly retryAfterMs: number | undefined;
  /** The BadRequest field violations (empty when there are none). */
  readonly violations: readonly FieldViolation[];

  constructor(
    code: Code,
    message: string,
    details: ReachErrorDetails = {},
    options?: ErrorOptions,
  ) {
    const reason = details.reason === undefined ? "" : ` [${details.reason}]`;
    super(`${codeName(code)}${reason}: ${message}`, options);
    this.name = "ReachError";
    this.code = code;
    this.statusMessage = message;
    this.reason = details.reason;
    this.domain = details.reason === undefined ? details.domain : (details.domain ?? ERROR_DOMAIN);
    this.metadata = { ...details.metadata };
    this.retryAfterMs = details.retryAfterMs;
    this.violations = [...(details.violations ?? [])];
  }

  /** The canonical name of {@link ReachError.code} (`NOT_FOUND`, `UNAVAILABLE`, ...). */
  get codeName(): string {
    return codeName(this.code);
  }

  /**
   * A status with an ErrorInfo of `reason` in the `reach.dev` domain, for a handler to throw.
   * `retryAfterMs` adds a RetryInfo.
   */
  static of(
    code: Code,
    message: string,
    reason: string,
    metadata: Record<string, string> = {},
    retryAfterMs?: number,
  ): ReachError {
    return new ReachError(code, message, { reason, domain: ERROR_DOMAIN, metadata, retryAfterMs });
  }

  /**
   * The error a status decodes to: `code`, `message` and `details`, the encoded
   * `google.rpc.Status` of `grpc-status-details-bin` (or of a multiplexed call's
   * `CallError.details`). Details that do not decode are ignored: the code and message stand.
   */
  static fromStatus(code: Code, message: string, details?: Uint8Array): ReachError {
    return new ReachError(code, message, decodeDetails(details));
  }

  /**
   * `error` as a ReachError: itself when it is one; a grpc-js call error decoded (code,
   * details, `grpc-status-details-bin`); anything else as UNKNOWN with its message.
   */
  static from(error: unknown): ReachError {
    if (error instanceof ReachError) {
      return error;
    }
    if (isStatusError(error)) {
      const [details] = error.metadata?.get(STATUS_DETAILS_KEY) ?? [];
      return new ReachError(
        error.code,
        error.details,
        decodeDetails(typeof details === "string" ? undefined : details),
        { cause: error },
      );
    }
    const message = error instanceof Error ? error.message : String(error);
    return new ReachError(Code.UNKNOWN, message, {}, { cause: error });
  }

  /** Whether the error carries details (ErrorInfo, RetryInfo or BadRequest) to encode. */
  get hasDetails(): boolean {
    return (
      this.reason !== undefined || this.retryAfterMs !== undefined || this.violations.length > 0
    );
  }

  /** The encoded `google.rpc.Status` (code, message, ErrorInfo, RetryInfo, BadRequest). */
  encodeStatus(): Uint8Array {
    const details = [];
    if (this.reason !== undefined) {
      details.push(
        anyPack(
          ErrorInfoSchema,
          create(ErrorInfoSchema, {
            reason: this.reason,
            domain: this.domain ?? ERROR_DOMAIN,
            metadata: { ...this.metadata },
          }),
        ),
      );
    }
    if (this.retryAfterMs !== undefined) {
      details.push(
        anyPack(
          RetryInfoSchema,
          create(RetryInfoSchema, { retryDelay: durationFromMs(this.retryAfterMs) }),
        ),
      );
    }
    if (this.violations.length > 0) {
      details.push(
        anyPack(
          BadRequestSchema,
          create(BadRequestSchema, {
            fieldViolations: this.violations.map((v) => ({ ...v })),
          }),
        ),
      );
    }
    return toBinary(
      StatusSchema,
      create(StatusSchema, { code: this.code, message: this.statusMessage, details }),
    );
  }

  /** The status grpc-js sends for this error: code, message and `grpc-status-details-bin`. */
  toGrpcStatus(): Partial<StatusObject> {
    const metadata = new Metadata();
    if (this.hasDetails) {
      metadata.set(STATUS_DETAILS_KEY, Buffer.from(this.encodeStatus()));
    }
    return { code: this.code, details: this.statusMessage, metadata };
  }
}

/** The canonical upper-case name of a gRPC code (`OK`, `NOT_FOUND`, ...). */
export function codeName(code: Code): string {
  return Code[code] ?? `CODE_${code}`;
}

/** Whether `error` is a grpc-js call error (a status with code, details and metadata). */
function isStatusError(error: unknown): error is Error & {
  code: Code;
  details: string;
  metadata?: Metadata;
} {
  return (
    error instanceof Error &&
    typeof (error as { code?: unknown }).code === "number" &&
    typeof (error as { details?: unknown }).details === "string"
  );
}

function decodeDetails(bytes: Uint8Array | undefined): ReachErrorDetails {
  if (bytes === undefined || bytes.length === 0) {
    return {};
  }
  let status;
  try {
    status = fromBinary(StatusSchema, bytes);
  } catch {
    return {};
  }
  let found: {
    reason?: string;
    domain?: string;
    metadata?: Record<string, string>;
    retryAfterMs?: number;
    violations?: FieldViolation[];
  } = {};
  for (const any of status.details) {
    const info = anyUnpack(any, ErrorInfoSchema);
    if (info !== undefined) {
      found = { ...found, reason: info.reason, domain: info.domain, metadata: info.metadata };
      continue;
    }
    const retry = anyUnpack(any, RetryInfoSchema);
    if (retry !== undefined) {
      if (retry.retryDelay !== undefined) {
        found.retryAfterMs = durationMs(retry.retryDelay);
      }
      continue;
    }
    const bad = anyUnpack(any, BadRequestSchema);
    if (bad !== undefined) {
      found.violations = bad.fieldViolations.map((v) => ({
        field: v.field,
        description: v.description,
      }));
    }
  }
  return found;
}
