/**
 * The caller's side of `RouterService.CallMux` (the Rust SDK's `reach_rpc::mux::MuxLink`):
 * many concurrent calls over one long-lived bidirectional stream, each a `CallFrame` out and
 * a `ReplyFrame` back tagged with its `call_id`, so a call costs one frame each way instead of
 * an HTTP/2 stream of its own.
 *
 * The stream opens on the first call and again after it breaks. A call whose caller gives up
 * (deadline, abort) sends a cancel frame. When the stream breaks, every waiting call fails
 * UNAVAILABLE saying it may or may not have been handled — unless the router ended it
 * draining (`INSTANCE_DRAINING`: the calls without a reply were not read), or the router does
 * not serve CallMux at all (UNIMPLEMENTED before any reply): then the calls are handed back
 * to go as unary `Call`s, and the link stays unary for {@link UNSUPPORTED_RETRY_AFTER_MS}.
 *
 * @module
 */

import { create } from "@bufbuild/protobuf";
import type * as grpc from "@grpc/grpc-js";

import { Code, codeName, Reason, ReachError } from "./errors.js";
import type { ReachMessage } from "./gen/reach/v1/envelope_pb.js";
import {
  type CallMuxRequest,
  CallMuxRequestSchema,
  type CallMuxResponse,
  RouterService,
} from "./gen/reach/v1/router_service_pb.js";
import type { RpcChannel } from "./rpc.js";
import { timerDelay } from "./sync.js";

/** How long a link remembers that the router does not serve CallMux before trying again. */
export const UNSUPPORTED_RETRY_AFTER_MS = 60_000;

/** What {@link CallMuxLink.call} resolves to when the call must go as a unary `Call`. */
export const UNSUPPORTED = Symbol("CallMux not served");

interface Waiter {
  resolve(response: CallMuxResponse | typeof UNSUPPORTED): void;
  reject(error: ReachError): void;
}

/** One open CallMux stream and the calls waiting on it. */
interface Session {
  stream: grpc.ClientDuplexStream<CallMuxRequest, CallMuxResponse>;
  nextCallId: bigint;
  waiting: Map<bigint, Waiter>;
  /** Whether any reply frame arrived (an UNIMPLEMENTED end after one is a broken stream). */
  answered: boolean;
  /** Set once the stream ended: no call may be sent on it. */
  broken: boolean;
}

/** The multiplexed stream of one client to its router. */
export class CallMuxLink {
  readonly #router: RpcChannel;
  #session: Session | undefined;
  #unsupportedUntil = 0;
  #streamsOpened = 0;

  constructor(router: RpcChannel) {
    this.#router = router;
  }

  /** How many CallMux streams this link opened (1 while the first lives; more after breaks). */
  get streamsOpened(): number {
    return this.#streamsOpened;
  }

  /**
   * Sends `message` as one call and resolves to the router's reply frame (a reply or an
   * error, see `CallMuxResponse.frame`), or to {@link UNSUPPORTED} when the router does not
   * serve CallMux (nothing was delivered: send it as a unary `Call`).
   *
   * @throws {ReachError} DEADLINE_EXCEEDED when `timeoutMs` passes first, CANCELLED when
   * `signal` aborts (both send a cancel frame), UNAVAILABLE when the stream broke while the
   * call waited (it may have been handled: resend with the same `message_id`).
   */
  call(
    message: ReachMessage,
    {
      timeoutMs,
      signal,
      metadata,
    }: {
      timeoutMs?: number | undefined;
      signal?: AbortSignal | undefined;
      metadata: Record<string, string>;
    },
  ): Promise<CallMuxResponse | typeof UNSUPPORTED> {
    if (Date.now() < this.#unsupportedUntil) {
      return Promise.resolve(UNSUPPORTED);
    }
    if (signal?.aborted) {
      return Promise.reject(
        new ReachError(Code.CANCELLED, "the call was cancelled before it was sent"),
      );
    }
    const session = this.#live();
    const callId = session.nextCallId;
    session.nextCallId += 1n;
    return new Promise((resolve, reject) => {
      let timer: NodeJS.Timeout | undefined;
      const settle = () => {
        clearTimeout(timer);
        signal?.removeEventListener("abort", abandon);
        session.waiting.delete(callId);
      };
      const giveUp = (error: ReachError) => {
        if (!session.waiting.has(callId)) {
          return;
        }
        settle();
        if (!session.broken) {
          session.stream.write(create(CallMuxRequestSchema, { frame: { callId, cancel: true } }));
        }
        reject(error);
      };
      const abandon = () =>
        giveUp(new ReachError(Code.CANCELLED, "the call was cancelled by its caller"));
      session.waiting.set(callId, {
        resolve: (response) => {
          settle();
          resolve(response);
        },
        reject: (error) => {
          settle();
          reject(error);
        },
      });
      if (timeoutMs !== undefined) {
        timer = setTimeout(
          () =>
            giveUp(
              new ReachError(
                Code.DEADLINE_EXCEEDED,
                `no reply within the call's timeout of ${timeoutMs} ms`,
              ),
            ),
          timerDelay(timeoutMs),
        );
      }
      signal?.addEventListener("abort", abandon, { once: true });
      session.stream.write(
        create(CallMuxRequestSchema, {
          frame: {
            callId,
            message,
            // Whole milliseconds, rounded up, at least 1 (0 means no deadline), at most u32.
            timeoutMs:
              timeoutMs === undefined
                ? 0
                : Math.min(2 ** 32 - 1, Math.max(1, Math.ceil(timeoutMs))),
            metadata,
          },
        }),
      );
    });
  }

  /** Closes the open stream, if any; its waiting calls fail UNAVAILABLE. */
  close(): void {
    this.#session?.stream.cancel();
  }

  /** The open stream, opened when there is none. */
  #live(): Session {
    if (this.#session !== undefined && !this.#session.broken) {
      return this.#session;
    }
    const session: Session = {
      stream: this.#router.bidi(RouterService.method.callMux),
      nextCallId: 1n,
      waiting: new Map(),
      answered: false,
      broken: false,
    };
    this.#streamsOpened += 1;
    this.#session = session;
    session.stream.on("data", (response: CallMuxResponse) => {
      session.answered = true;
      const callId = response.frame?.callId;
      // No waiter: a cancelled call's answer, or its acknowledgement.
      if (callId !== undefined) {
        session.waiting.get(callId)?.resolve(response);
      }
    });
    session.stream.on("error", (error: unknown) => this.#broke(session, ReachError.from(error)));
    session.stream.on("status", (status: grpc.StatusObject) =>
      this.#broke(session, ReachError.fromStatus(status.code, status.details)),
    );
    return session;
  }

  /** Fails (or hands back) every call waiting on `session`, which ended with `cause`. */
  #broke(session: Session, cause: ReachError): void {
    if (session.broken) {
      return;
    }
    session.broken = true;
    if (this.#session === session) {
      this.#session = undefined;
    }
    const unsupported = cause.code === Code.UNIMPLEMENTED && !session.answered;
    if (unsupported) {
      this.#unsupportedUntil = Date.now() + UNSUPPORTED_RETRY_AFTER_MS;
    }
    for (const waiter of [...session.waiting.values()]) {
      if (unsupported) {
        waiter.resolve(UNSUPPORTED);
      } else if (cause.reason === Reason.INSTANCE_DRAINING) {
        // The router answered every call it read before it ended the stream.
        waiter.reject(cause);
      } else {
        waiter.reject(
          new ReachError(
            Code.UNAVAILABLE,
            `the connection broke while the call was in flight (${codeName(cause.code)}: ${cause.statusMessage}); the message may or may not have been handled: retry with the same message_id to be safe`,
          ),
        );
      }
    }
  }
}
