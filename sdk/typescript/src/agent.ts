/**
 * The serving, registering agent behind a `RunningAgent`: the gRPC server (AgentService's
 * Handle, HandleMux and HandleStream, and `grpc.health.v1`), the registration loop, the
 * handling of one message (dedupe, concurrency slot, deadline, reply envelope) and the drain.
 * `runtime.ts` holds the public API over it.
 *
 * @module
 */

import { create, toBinary } from "@bufbuild/protobuf";
import { durationFromMs, durationMs, timestampNow } from "@bufbuild/protobuf/wkt";
import * as grpc from "@grpc/grpc-js";
import { randomUUID } from "node:crypto";

import { DedupeCache } from "./dedupe.js";
import { Code, Reason, ReachError } from "./errors.js";
import { Health } from "./gen/grpc/health/v1/health_pb.js";
import {
  AgentService,
  type HandleMuxRequest,
  type HandleMuxResponse,
  HandleMuxResponseSchema,
  type HandleRequest,
  type HandleResponse,
  HandleResponseSchema,
  type HandleStreamRequest,
  type HandleStreamResponse,
  HandleStreamResponseSchema,
} from "./gen/reach/v1/agent_service_pb.js";
import {
  type Header,
  HeaderSchema,
  PayloadSchema,
  type ReachMessage,
  ReachMessageSchema,
} from "./gen/reach/v1/envelope_pb.js";
import {
  type Capability,
  type InstanceSpec,
  InstanceSpecSchema,
  InstanceState,
  RegistryService,
} from "./gen/reach/v1/registry_service_pb.js";
import { HealthReporter, ServingStatus } from "./health.js";
import { newMessageId } from "./ids.js";
import type { Logger } from "./log.js";
import { DataTooDeepError, MAX_DATA_DEPTH, tooDeepPart } from "./parts.js";
import { RpcChannel, serviceDefinition } from "./rpc.js";
import {
  type AuthenticatedCall,
  CALLER_METADATA,
  type DirectCallers,
  peerIdentity,
  serverCredentials,
  type TlsFiles,
  vouchedCaller,
} from "./trust.js";
import type { Handler, HandlerContext, PayloadInit, StreamHandler } from "./runtime.js";
import { AsyncQueue, delay, Semaphore, timerDelay } from "./sync.js";

/** The gRPC service every agent serves (and the registry's probe asks about). */
export const AGENT_SERVICE = "reach.v1.AgentService";

/** The most reply metadata entries a handler may set. */
export const MAX_REPLY_METADATA_ENTRIES = 64;
/** The longest reply metadata key, in bytes. */
export const MAX_REPLY_METADATA_KEY_BYTES = 128;
/** The longest reply metadata value, in bytes. */
export const MAX_REPLY_METADATA_VALUE_BYTES = 1024;
/** Calls one multiplexed stream may have unanswered at once; more are refused OVERLOADED. */
export const MAX_OPEN_CALLS_PER_STREAM = 1024;
/** The most per-call metadata a multiplexed frame may carry (keys plus values, bytes). */
export const MAX_CALL_METADATA_BYTES = 8 * 1024;
/** Bytes a multiplexed frame spends around its message; the transport allows this much more. */
export const FRAME_OVERHEAD_BYTES = 16 * 1024;
/** How long streams still open at the end of a drain get before their connections close. */
const SERVER_GRACE_AFTER_DRAIN_MS = 1000;
/** The retry hint of a multiplexed call refused because its stream has too many calls open. */
const OVERLOADED_RETRY_AFTER_MS = 50;
/**
 * The most an instance waits (a random share of it, at most a quarter of its heartbeat
 * period) before registering again when the registry no longer knows its lease.
 */
const REREGISTER_SPREAD_MS = 250;
/** The longest a failed heartbeat waits before it is retried (or the period, if shorter). */
const HEARTBEAT_RETRY_MAX_MS = 1000;

/** `ms` spread uniformly over [ms/2, 3ms/2]: retries of many instances come apart. */
function jittered(ms: number): number {
  return ms * (0.5 + Math.random());
}
/**
 * Reasons that tell a caller its message was not delivered, so it may be sent elsewhere or
 * again (`docs/errors.md`). A handler that lets a nested call's error with one of them escape
 * answers FAILED_PRECONDITION instead (see `Agent.#handlerFailure`).
 */
const DELIVERY_REASONS: ReadonlySet<string | undefined> = new Set([
  Reason.ROUTE_NOT_FOUND,
  Reason.INSTANCE_DRAINING,
  Reason.OVERLOADED,
  Reason.INSTANCE_UNAVAILABLE,
]);

/** The validated agent options, with defaults filled in. */
export interface Settings {
  service: string;
  registry: string;
  instanceId: string;
  listen: string;
  advertiseHost: string;
  protocolVersion: string;
  maxConcurrency: number;
  maxDrainMs: number;
  leaseTtlMs: number;
  dedupeWindowMs: number;
  dedupeCapacity: number;
  dedupeMaxBytes: number;
  weight: number;
  topics: string[];
  labels: Record<string, string>;
  maxMessageBytes: number;
  logger: Logger;
  trustDomain: string;
  tls: TlsFiles | undefined;
  joinToken: string;
  /** Who may call this agent directly when it serves TLS. */
  callers: DirectCallers;
}

/** Registration refusals no retry can fix: the spec itself, or the right to register. */
const FINAL_REFUSALS: ReadonlySet<Code> = new Set([
  Code.INVALID_ARGUMENT,
  Code.FAILED_PRECONDITION,
  Code.PERMISSION_DENIED,
  Code.UNAUTHENTICATED,
]);

/** Who a call comes from: the connection's client identity, and the caller it names. */
interface Caller {
  peer: string | undefined;
  vouched: string | undefined;
}

/** The first text value of `key` in `metadata`. */
function firstValue(metadata: grpc.Metadata, key: string): string | undefined {
  const [value] = metadata.get(key);
  return typeof value === "string" ? value : undefined;
}

/** What handling one message came to: the reply envelope, or the status to answer with. */
type Outcome =
  { reply: ReachMessage; error?: undefined } | { reply?: undefined; error: ReachError };

/** The serving, registering agent behind a `RunningAgent`. */
export class Agent {
  readonly settings: Settings;
  readonly #handlers: Map<string, Handler>;
  readonly #streamHandlers: Map<string, StreamHandler>;
  readonly #capabilities: Capability[];
  readonly #source: string;
  readonly #server: grpc.Server;
  readonly #health = new HealthReporter();
  readonly #permits: Semaphore;
  readonly #dedupe: DedupeCache<Outcome>;
  readonly #registry: RpcChannel;
  /**
   * Who may call this agent (the routers, whose `x-reach-caller` is believed): only when
   * serving TLS.
   */
  readonly #callers: DirectCallers | undefined;
  /** Aborted when the drain begins: heartbeats stop, multiplexed streams stop reading. */
  readonly #closing = new AbortController();
  /** Woken each time the last message in flight finishes. */
  #idle: Array<() => void> = [];
  #inFlight = 0;
  #muxStreams = 0;
  #leaseId: string | undefined;
  #heartbeats: Promise<void> | undefined;
  #drained: Promise<void> | undefined;
  /** Resolves with the registry's error once it refused the registration for good. */
  readonly refused: Promise<ReachError>;
  #refuse: (error: ReachError) => void = () => {};
  endpoint = "";

  constructor(
    settings: Settings,
    handlers: Map<string, Handler>,
    streamHandlers: Map<string, StreamHandler>,
    capabilities: Capability[],
  ) {
    this.settings = settings;
    this.refused = new Promise((resolve) => {
      this.#refuse = resolve;
    });
    this.#handlers = handlers;
    this.#streamHandlers = streamHandlers;
    this.#capabilities = capabilities;
    this.#source = `${settings.service}.${settings.instanceId}`;
    this.#permits = new Semaphore(settings.maxConcurrency);
    this.#dedupe = new DedupeCache(
      settings.dedupeWindowMs,
      settings.dedupeCapacity,
      settings.dedupeMaxBytes,
    );
    this.#registry = new RpcChannel(settings.registry, 4 * 1024 * 1024, { tls: settings.tls });
    this.#callers = settings.tls?.cert === undefined ? undefined : settings.callers;
    const frameLimit = settings.maxMessageBytes + FRAME_OVERHEAD_BYTES;
    this.#server = new grpc.Server({
      "grpc.max_receive_message_length": frameLimit,
      "grpc.max_send_message_length": frameLimit,
    });
  }

  get inFlight(): number {
    return this.#inFlight;
  }

  /** Who `call` comes from: the connection's peer (when serving TLS) and its `x-reach-caller`. */
  #callerOf(call: AuthenticatedCall, vouched: string | undefined): Caller {
    return { peer: this.#callers === undefined ? undefined : peerIdentity(call), vouched };
  }

  get muxStreamsOpened(): number {
    return this.#muxStreams;
  }

  /** Binds, serves AgentService and health, and starts the registration loop. */
  async serve(): Promise<void> {
    // Serving TLS, the agent answers only routers (and the registry's health probes).
    const add = (
      definition: grpc.ServiceDefinition,
      implementation: grpc.UntypedServiceImplementation,
    ) => {
      const callers = this.#callers;
      this.#server.addService(
        definition,
        callers === undefined
          ? implementation
          : callers.guard(definition, implementation, (refusal) =>
              this.settings.logger.warn("denied", {
                who: refusal.metadata.identity ?? "",
                action: "call",
                target: refusal.metadata.target ?? "",
                decision: "denied",
                reason: refusal.statusMessage,
              }),
            ),
      );
    };
    add(agentServiceDefinition(), {
      handle: this.#serveHandle,
      handleStream: this.#serveStream,
      handleMux: this.#serveMux,
    } satisfies {
      handle: grpc.handleUnaryCall<HandleRequest, HandleResponse>;
      handleStream: grpc.handleBidiStreamingCall<
        HandleStreamRequest | Undecodable,
        HandleStreamResponse
      >;
      handleMux: grpc.handleBidiStreamingCall<HandleMuxRequest | Undecodable, HandleMuxResponse>;
    });
    add(serviceDefinition(Health), this.#health.implementation());
    const port = await new Promise<number>((resolve, reject) => {
      this.#server.bindAsync(
        this.settings.listen,
        this.#callers === undefined || this.settings.tls === undefined
          ? grpc.ServerCredentials.createInsecure()
          : serverCredentials(this.settings.tls),
        (error, bound) =>
          error === null ? resolve(bound) : reject(listenError(this.settings.listen, error)),
      );
    });
    const host = this.settings.advertiseHost;
    this.endpoint = host.includes(":") ? `http://[${host}]:${port}` : `http://${host}:${port}`;
    this.#health.set(AGENT_SERVICE, ServingStatus.SERVING);
    this.#health.set("", ServingStatus.SERVING);
    this.#heartbeats = this.#keepRegistered(this.#spec());
    this.settings.logger.info("agent serving", {
      instance: this.settings.instanceId,
      endpoint: this.endpoint,
    });
  }

  drain(): Promise<void> {
    this.#drained ??= this.#drain();
    return this.#drained;
  }

  async #drain(): Promise<void> {
    const { logger, instanceId, maxDrainMs } = this.settings;
    this.#health.set(AGENT_SERVICE, ServingStatus.NOT_SERVING);
    this.#health.set("", ServingStatus.NOT_SERVING);
    this.#closing.abort();
    await this.#heartbeats;
    const leaseId = this.#leaseId;
    if (leaseId !== undefined) {
      try {
        await this.#registry.unary(
          RegistryService.method.heartbeat,
          { instanceId, leaseId, state: InstanceState.DRAINING, inFlight: this.#inFlight },
          { timeoutMs: 2000 },
        );
      } catch (error) {
        logger.warn("could not report draining", {
          instance: instanceId,
          error: ReachError.from(error).message,
        });
      }
    }
    logger.info("draining", { instance: instanceId, in_flight: this.#inFlight });
    const idle = new AbortController();
    const drained = await Promise.race([
      this.#waitIdle().then(() => true),
      delay(maxDrainMs, idle.signal).then(() => false),
    ]);
    idle.abort();
    if (!drained) {
      logger.warn("drain time exceeded; abandoning in-flight work", {
        instance: instanceId,
        in_flight: this.#inFlight,
        max_drain_ms: maxDrainMs,
      });
    }
    if (leaseId !== undefined) {
      try {
        await this.#registry.unary(
          RegistryService.method.deregister,
          { instanceId, leaseId },
          { timeoutMs: 2000 },
        );
      } catch (error) {
        logger.warn("could not deregister; the lease will expire", {
          instance: instanceId,
          error: ReachError.from(error).message,
        });
      }
    }
    await new Promise<void>((resolve) => {
      const force = setTimeout(() => {
        this.#server.forceShutdown();
        resolve();
      }, SERVER_GRACE_AFTER_DRAIN_MS);
      this.#server.tryShutdown(() => {
        clearTimeout(force);
        resolve();
      });
    });
    this.#registry.close();
    logger.info("agent stopped", { instance: instanceId });
  }

  #spec(): InstanceSpec {
    const s = this.settings;
    return create(InstanceSpecSchema, {
      service: s.service,
      instanceId: s.instanceId,
      endpoint: this.endpoint,
      capabilities: this.#capabilities,
      protocolVersion: s.protocolVersion,
      weight: s.weight,
      maxConcurrency: s.maxConcurrency,
      topics: s.topics,
      labels: s.labels,
    });
  }

  // === registration ===

  /**
   * Registers, then heartbeats every third of the granted lease until the drain begins;
   * registers again whenever the registry no longer knows the lease (NOT_FOUND, as after a
   * registry restart), after a random share of up to 250 ms (at most a quarter of the period)
   * so that a restarted registry's instances do not all register at once. Registration is
   * retried with jittered back-off (20 ms doubling to 2 s, each delay drawn from [d/2, 3d/2])
   * while the registry is unreachable, a failed heartbeat likewise (20 ms doubling up to the
   * period or 1 s, so a registry back from an outage is found within about a second), and
   * given up when the registry refuses the spec itself (INVALID_ARGUMENT or
   * FAILED_PRECONDITION) or the right to register (PERMISSION_DENIED, UNAUTHENTICATED): no
   * retry can fix it; {@link Agent.refused} resolves. An operator's drain (`INSTANCE_DRAINED`, or DRAINING in a heartbeat's answer) ends the loop
   * for good: the instance takes no new work through the registry and never registers again.
   */
  async #keepRegistered(spec: InstanceSpec): Promise<void> {
    const { logger, leaseTtlMs, maxConcurrency } = this.settings;
    const stop = this.#closing.signal;
    let backoffMs = 20;
    // The join token proves the right to register; heartbeats then authenticate with the
    // lease id the registration granted.
    const { joinToken } = this.settings;
    const credentials = joinToken ? { authorization: `Bearer ${joinToken}` } : undefined;
    while (!stop.aborted) {
      let granted;
      try {
        granted = await this.#registry.unary(
          RegistryService.method.register,
          { instance: spec, leaseTtl: durationFromMs(leaseTtlMs) },
          { timeoutMs: 5000, signal: stop, metadata: credentials },
        );
      } catch (error) {
        if (stop.aborted) {
          return;
        }
        const status = ReachError.from(error);
        if (FINAL_REFUSALS.has(status.code)) {
          logger.warn("the registry refused the registration; not retrying", {
            code: status.codeName,
            error: status.statusMessage,
          });
          this.#refuse(status);
          return;
        }
        const retryInMs = jittered(backoffMs);
        logger.warn("registration failed; retrying", {
          code: status.codeName,
          error: status.statusMessage,
          retry_in_ms: retryInMs,
        });
        await delay(retryInMs, stop);
        backoffMs = Math.min(backoffMs * 2, 2000);
        continue;
      }
      backoffMs = 20;
      this.#leaseId = granted.leaseId;
      const ttlMs = granted.leaseTtl === undefined ? leaseTtlMs : durationMs(granted.leaseTtl);
      const periodMs = Math.max(Math.floor(ttlMs / 3), 10);
      logger.info("registered", { instance: spec.instanceId, lease_ttl_ms: ttlMs });
      let waitMs = periodMs;
      let retryMs = 20;
      for (;;) {
        await delay(waitMs, stop);
        if (stop.aborted) {
          return;
        }
        const inFlight = this.#inFlight;
        const state = inFlight >= maxConcurrency ? InstanceState.BUSY : InstanceState.READY;
        try {
          const answer = await this.#registry.unary(
            RegistryService.method.heartbeat,
            { instanceId: spec.instanceId, leaseId: granted.leaseId, state, inFlight },
            { timeoutMs: Math.max(periodMs, 1000), signal: stop },
          );
          waitMs = periodMs;
          retryMs = 20;
          if (answer.state === InstanceState.DRAINING) {
            logger.warn(
              "the registry drained this instance; no longer taking new work through it",
              { instance: spec.instanceId },
            );
            return;
          }
        } catch (error) {
          if (stop.aborted) {
            return;
          }
          const status = ReachError.from(error);
          if (status.reason === Reason.INSTANCE_DRAINED) {
            logger.warn(
              "the registry drained this instance; no longer taking new work through it",
              { instance: spec.instanceId },
            );
            return;
          }
          if (status.code === Code.NOT_FOUND) {
            const afterMs = Math.random() * Math.min(periodMs / 4, REREGISTER_SPREAD_MS);
            logger.warn("registry lost the lease; registering again", {
              instance: spec.instanceId,
              after_ms: Math.round(afterMs),
            });
            await delay(afterMs, stop);
            break;
          }
          waitMs = Math.min(jittered(retryMs), periodMs);
          retryMs = Math.min(retryMs * 2, HEARTBEAT_RETRY_MAX_MS, periodMs);
          logger.warn("heartbeat failed", {
            code: status.codeName,
            error: status.statusMessage,
            retry_in_ms: Math.round(waitMs),
          });
        }
      }
    }
  }

  // === handling ===

  #enter(): void {
    this.#inFlight += 1;
  }

  #exit(): void {
    this.#inFlight -= 1;
    if (this.#inFlight === 0) {
      const waiting = this.#idle;
      this.#idle = [];
      for (const wake of waiting) {
        wake();
      }
    }
  }

  #waitIdle(): Promise<void> {
    return this.#inFlight === 0
      ? Promise.resolve()
      : new Promise((resolve) => this.#idle.push(resolve));
  }

  #drainingError(): ReachError {
    const id = this.settings.instanceId;
    return ReachError.of(
      Code.UNAVAILABLE,
      `instance ${id} is draining and takes no new work; send it elsewhere`,
      Reason.INSTANCE_DRAINING,
      { instance_id: id },
    );
  }

  #tooLarge(what: "message" | "reply", size: number): ReachError {
    const limit = this.settings.maxMessageBytes;
    return ReachError.of(
      Code.RESOURCE_EXHAUSTED,
      `the ${what} is ${size} bytes, over this agent's limit of ${limit} bytes (maxMessageBytes); send large content by url, or raise the limit`,
      Reason.PAYLOAD_TOO_LARGE,
      { size_bytes: String(size), limit_bytes: String(limit) },
    );
  }

  /**
   * The handler for `message`: by the addressed capability, else (service-addressed) by the
   * payload type when it names a capability, else the only handler there is.
   */
  #pick<H>(handlers: Map<string, H>, message: ReachMessage): H | ReachError {
    const target = message.header?.target;
    let wanted: string | undefined;
    if (target?.case === "capability") {
      wanted = target.value;
    } else if (message.payload !== undefined && handlers.has(message.payload.type)) {
      wanted = message.payload.type;
    }
    const found =
      wanted !== undefined
        ? handlers.get(wanted)
        : handlers.size === 1
          ? handlers.values().next().value
          : undefined;
    if (found !== undefined) {
      return found;
    }
    const known = [...handlers.keys()].sort().join(", ");
    const what =
      wanted === undefined
        ? "this message (address a capability)"
        : `capability ${JSON.stringify(wanted)}`;
    return ReachError.of(
      Code.UNIMPLEMENTED,
      `instance ${this.settings.instanceId} has no handler for ${what}; it handles: ${known}`,
      Reason.CAPABILITY_NOT_HANDLED,
    );
  }

  #context(
    message: ReachMessage,
    deadline: number | undefined,
    signal: AbortSignal,
    metadata: ReplyMetadata,
    caller: Caller,
  ): HandlerContext {
    const header = message.header ?? create(HeaderSchema);
    return {
      traceId: header.traceId,
      taskId: header.taskId,
      messageId: header.messageId,
      turn: header.turn,
      capability: header.target.case === "capability" ? header.target.value : "",
      deadline,
      signal,
      instanceId: this.settings.instanceId,
      replyTo: header.replyTo,
      caller: vouchedCaller(this.#callers, caller.peer, caller.vouched),
      setReplyMetadata: (key, value) => metadata.set(key, value, this.settings.logger),
    };
  }

  /**
   * The reply envelope of `payload` answering `request`, or the error that answers instead:
   * INTERNAL when the payload cannot be sent (a data part nesting deeper than
   * {@link MAX_DATA_DEPTH}, which the router could not decode inside the multiplexed stream
   * other calls share; a payload that is not valid or cannot be encoded), PAYLOAD_TOO_LARGE when
   * the reply is larger than `maxMessageBytes`.
   */
  #replyOutcome(
    request: Header | undefined,
    payload: PayloadInit,
    metadata: Record<string, string>,
    capability: string,
  ): Outcome {
    let error: ReachError;
    try {
      const reply = this.#reply(request, payload, metadata);
      const tooDeep = tooDeepPart(reply.payload);
      if (tooDeep === undefined) {
        const size = toBinary(ReachMessageSchema, reply).length;
        return size > this.settings.maxMessageBytes
          ? { error: this.#tooLarge("reply", size) }
          : { reply };
      }
      error = new ReachError(
        Code.INTERNAL,
        `the handler's reply part ${tooDeep.part} nests ${tooDeep.depth} levels deep, over the limit of ${MAX_DATA_DEPTH}; the reply was not sent: flatten it`,
      );
    } catch (failure) {
      error = new ReachError(
        Code.INTERNAL,
        `the handler's reply cannot be sent: ${failure instanceof Error ? failure.message : String(failure)}`,
      );
    }
    this.settings.logger.warn("handler returned a reply that cannot be sent", {
      capability,
      error: error.statusMessage,
    });
    return { error };
  }

  /**
   * What a handler's failure answers its caller. A {@link DataTooDeepError} (`dataPart`
   * refused what the reply was being built from) answers INTERNAL. A {@link ReachError} with a
   * delivery reason (`ROUTE_NOT_FOUND`, `INSTANCE_DRAINING`, `OVERLOADED`,
   * `INSTANCE_UNAVAILABLE`) came from a call the handler made; forwarded as it is, the router,
   * the orchestrator and callers would take this message for "not delivered" and send it again
   * or elsewhere, although the handler ran: it answers FAILED_PRECONDITION, without a reason,
   * with the message prefixed `a call this handler made failed: `. Any other ReachError answers
   * as it is. Anything else thrown answers INTERNAL, `handler failed; error id <uuid>; see the
   * agent's log`, as in the Rust and Python SDKs: what it said (which may hold anything the
   * handler had at hand) goes to the agent's log under that id, never to the caller.
   */
  #handlerFailure(error: unknown, capability: string): ReachError {
    if (error instanceof DataTooDeepError) {
      this.settings.logger.warn("handler returned a reply that cannot be sent", {
        capability,
        error: error.message,
      });
      return new ReachError(
        Code.INTERNAL,
        `the handler's reply nests ${error.depth} levels deep, over the limit of ${error.limit} (level ${error.limit + 1} begins at ${error.path}); the reply was not sent: flatten it`,
      );
    }
    const failure = ReachError.from(error);
    if (!(error instanceof ReachError) && failure.code === Code.UNKNOWN) {
      const errorId = randomUUID();
      this.settings.logger.warn("handler failed", {
        error_id: errorId,
        capability,
        error: error instanceof Error ? `${error.name}: ${error.message}` : String(error),
        stack: error instanceof Error ? (error.stack ?? "") : "",
      });
      return new ReachError(
        Code.INTERNAL,
        `handler failed; error id ${errorId}; see the agent's log`,
      );
    }
    if (!DELIVERY_REASONS.has(failure.reason)) {
      return failure;
    }
    return new ReachError(
      Code.FAILED_PRECONDITION,
      `a call this handler made failed: ${failure.statusMessage}`,
    );
  }

  /** The envelope of `payload` answering a request with `request` as its header. */
  #reply(
    request: Header | undefined,
    payload: PayloadInit,
    metadata: Record<string, string>,
  ): ReachMessage {
    return create(ReachMessageSchema, {
      header: {
        messageId: newMessageId(),
        traceId: request?.traceId ?? "",
        taskId: request?.taskId ?? "",
        source: this.#source,
        protocolVersion: this.settings.protocolVersion,
        createdAt: timestampNow(),
        correlationId: request?.messageId ?? "",
        turn: (request?.turn ?? 0) + 1,
        metadata,
      },
      payload: create(PayloadSchema, payload),
    });
  }

  /**
   * Handles one message (Handle and HandleMux): size check, handler pick, the dedupe slot,
   * the in-flight count, a concurrency slot, the handler, the reply envelope, the deadline.
   *
   * `cancelled` aborts when the caller gives up (a reset stream, a cancel frame). When it
   * does, or the deadline passes, the handler is told (its context's signal); with `settle`
   * (a multiplexed call) this resolves only once the handler has finished, so the router
   * keeps counting the call against this instance while its handler runs.
   */
  async #handleMessage(
    message: ReachMessage,
    deadline: number | undefined,
    cancelled: AbortSignal,
    settle: boolean,
    caller: Caller,
  ): Promise<Outcome> {
    const size = toBinary(ReachMessageSchema, message).length;
    if (size > this.settings.maxMessageBytes) {
      return { error: this.#tooLarge("message", size) };
    }
    const handler = this.#pick(this.#handlers, message);
    if (handler instanceof ReachError) {
      return { error: handler };
    }
    const told = new AbortController();
    const tell = () => told.abort();
    cancelled.addEventListener("abort", tell, { once: true });
    const metadata = new ReplyMetadata();
    const ctx = this.#context(message, deadline, told.signal, metadata, caller);
    const messageId = ctx.messageId;

    const run = async (): Promise<Outcome | undefined> => {
      if (!(await this.#permits.acquire(told.signal))) {
        return undefined;
      }
      let payload: PayloadInit;
      try {
        payload = await handler(ctx, message);
      } catch (error) {
        return { error: this.#handlerFailure(error, ctx.capability) };
      } finally {
        this.#permits.release();
      }
      return this.#replyOutcome(message.header, payload, metadata.take(), ctx.capability);
    };
    // Counted in flight until the handler returns, even after the caller has gone: a drain
    // waits for it. Its outcome is remembered under the message id, so a redelivery gets it
    // instead of running the handler again; a message that never got a slot is not.
    this.#enter();
    // Remembered per caller (the one the router verified): a message id is the caller's to
    // choose, so keyed by the id alone one principal's answer could be handed to another's
    // redelivery.
    const dedupeKey = ctx.caller === undefined ? messageId : `${ctx.caller}\u0000${messageId}`;
    const task = (messageId === "" ? run() : this.#dedupe.once(dedupeKey, run, remembered))
      .then(
        (outcome): Outcome =>
          outcome ?? {
            error: new ReachError(
              Code.CANCELLED,
              "the caller gave up while the message waited for a handler slot; it was not handled",
            ),
          },
      )
      .finally(() => this.#exit());

    let timer: NodeJS.Timeout | undefined;
    const interrupted = new Promise<ReachError>((resolve) => {
      if (deadline !== undefined) {
        timer = setTimeout(
          () =>
            resolve(
              ReachError.of(
                Code.DEADLINE_EXCEEDED,
                "the caller's deadline passed before the handler finished",
                Reason.DEADLINE_EXCEEDED,
              ),
            ),
          timerDelay(deadline - Date.now()),
        );
      }
      const onCancel = () =>
        resolve(
          new ReachError(
            Code.CANCELLED,
            "the caller cancelled the call; the handler was told and has finished",
          ),
        );
      if (cancelled.aborted) {
        onCancel();
      } else {
        cancelled.addEventListener("abort", onCancel, { once: true });
        void task.finally(() => cancelled.removeEventListener("abort", onCancel));
      }
    });
    const first = await Promise.race([task, interrupted]);
    clearTimeout(timer);
    cancelled.removeEventListener("abort", tell);
    if (first instanceof ReachError) {
      told.abort();
      if (settle) {
        await task;
      }
      return { error: first };
    }
    return first;
  }

  // === AgentService ===

  readonly #serveHandle: grpc.handleUnaryCall<HandleRequest, HandleResponse> = (call, callback) => {
    if (this.#closing.signal.aborted) {
      callback(this.#drainingError().toGrpcStatus(), null);
      return;
    }
    const message = call.request.message;
    if (message === undefined) {
      callback(
        new ReachError(Code.INVALID_ARGUMENT, "the request has no message").toGrpcStatus(),
        null,
      );
      return;
    }
    const gone = new AbortController();
    call.once("cancelled", () => gone.abort());
    const caller = this.#callerOf(call, firstValue(call.metadata, CALLER_METADATA));
    void this.#handleMessage(
      message,
      deadlineOf(call.getDeadline()),
      gone.signal,
      false,
      caller,
    ).then((outcome) => {
      if (outcome.error !== undefined) {
        callback(outcome.error.toGrpcStatus(), null);
      } else {
        callback(null, create(HandleResponseSchema, { message: outcome.reply }));
      }
    });
  };

  /**
   * HandleMux: every call frame runs as {@link Agent.#handleMessage} would for Handle; a
   * cancel frame tells its handler and the reply (CANCELLED, or the handler's outcome if it
   * finished first) acknowledges it. At most {@link MAX_OPEN_CALLS_PER_STREAM} calls are
   * unanswered at once (a call counts until its reply is flushed); more are refused
   * UNAVAILABLE / `OVERLOADED`. Every call read gets exactly one answer. When the drain begins
   * the stream reads no more frames, answers every call it read, and ends UNAVAILABLE /
   * `INSTANCE_DRAINING`: calls without a reply were not read, and the router sends them
   * elsewhere. A frame that cannot be decoded (its call id unknown, it cannot be refused alone)
   * does the same, ending INVALID_ARGUMENT / `INVALID_FRAME`.
   */
  readonly #serveMux: grpc.handleBidiStreamingCall<
    HandleMuxRequest | Undecodable,
    HandleMuxResponse
  > = (call) => {
    if (this.#closing.signal.aborted) {
      call.emit("error", this.#drainingError().toGrpcStatus());
      return;
    }
    this.#muxStreams += 1;
    // Every call on the stream comes from the connection's peer.
    const peer = this.#callers === undefined ? undefined : peerIdentity(call);
    // Response headers now: the router waits for them before it sends its first frame.
    call.sendMetadata(new grpc.Metadata());
    const open = new Map<bigint, { generation: number; cancel: AbortController }>();
    let generation = 0;
    let unanswered = 0;
    let inputEnded = false;
    let finished = false;
    /** Set when the caller went away: nobody reads replies any more. */
    let gone = false;
    /** Set when a frame could not be decoded: the status the stream ends with. */
    let undecodable: ReachError | undefined;
    const closing = this.#closing.signal;

    const finish = () => {
      if (
        finished ||
        unanswered > 0 ||
        !(inputEnded || closing.aborted || undecodable !== undefined)
      ) {
        return;
      }
      finished = true;
      closing.removeEventListener("abort", finish);
      if (undecodable !== undefined) {
        call.emit("error", undecodable.toGrpcStatus());
      } else if (closing.aborted) {
        call.emit(
          "error",
          new ReachError(
            Code.UNAVAILABLE,
            "the callee is shutting down and read no more calls from this stream; calls without a reply were not handled, send them elsewhere",
            { reason: Reason.INSTANCE_DRAINING },
          ).toGrpcStatus(),
        );
      } else {
        call.end();
      }
    };
    const answer = (callId: bigint, outcome: Outcome) => {
      if (gone) {
        return;
      }
      const frame = create(HandleMuxResponseSchema, {
        frame: {
          callId,
          result:
            outcome.error === undefined
              ? { case: "reply", value: outcome.reply }
              : {
                  case: "error",
                  value: {
                    code: outcome.error.code,
                    message: outcome.error.statusMessage,
                    details: outcome.error.hasDetails
                      ? outcome.error.encodeStatus()
                      : new Uint8Array(),
                  },
                },
        },
      });
      call.write(frame, () => {
        unanswered -= 1;
        finish();
      });
    };
    const refuse = (callId: bigint, error: ReachError) => {
      unanswered += 1;
      answer(callId, { error });
    };

    closing.addEventListener("abort", finish, { once: true });
    call.on("data", (request: HandleMuxRequest | Undecodable) => {
      if (undecodable !== undefined) {
        // Not read: the stream's closing status says calls without a reply were not handled.
        return;
      }
      if (request instanceof Undecodable) {
        this.settings.logger.warn("a HandleMux frame could not be decoded; ending the stream", {
          error: request.why,
        });
        undecodable = ReachError.of(
          Code.INVALID_ARGUMENT,
          `a frame on this stream could not be decoded (${request.why}); send HandleMuxRequests whose data nests at most ${MAX_DATA_DEPTH} levels (MAX_DATA_DEPTH). No frame after it was read: calls without a reply were not handled, send them again`,
          Reason.INVALID_FRAME,
        );
        finish();
        return;
      }
      const frame = request.frame;
      if (frame === undefined) {
        refuse(0n, invalidFrame(0n));
        return;
      }
      const callId = frame.callId;
      if (frame.cancel) {
        open.get(callId)?.cancel.abort();
        return;
      }
      if (closing.aborted || finished) {
        // Not read into a handler: the stream's closing status tells the router to send it
        // elsewhere.
        return;
      }
      if (open.has(callId)) {
        refuse(
          callId,
          ReachError.of(
            Code.INVALID_ARGUMENT,
            `call_id ${callId} is already open on this stream; use a new id per call (the open call still gets its own reply)`,
            Reason.CALL_ID_IN_USE,
            { call_id: String(callId) },
          ),
        );
        return;
      }
      if (unanswered >= MAX_OPEN_CALLS_PER_STREAM) {
        refuse(
          callId,
          ReachError.of(
            Code.UNAVAILABLE,
            `${MAX_OPEN_CALLS_PER_STREAM} calls are already open on this stream; the call was not handled: retry after the hint, or wait for replies`,
            Reason.OVERLOADED,
            { max_open_calls: String(MAX_OPEN_CALLS_PER_STREAM) },
            OVERLOADED_RETRY_AFTER_MS,
          ),
        );
        return;
      }
      const metadataBytes = Object.entries(frame.metadata).reduce(
        (sum, [key, value]) => sum + Buffer.byteLength(key) + Buffer.byteLength(value),
        0,
      );
      if (metadataBytes > MAX_CALL_METADATA_BYTES) {
        refuse(
          callId,
          ReachError.of(
            Code.RESOURCE_EXHAUSTED,
            `call ${callId}'s metadata is ${metadataBytes} bytes, over the limit of ${MAX_CALL_METADATA_BYTES} bytes; put large values in the message`,
            Reason.PAYLOAD_TOO_LARGE,
            { size_bytes: String(metadataBytes), limit_bytes: String(MAX_CALL_METADATA_BYTES) },
          ),
        );
        return;
      }
      if (frame.message === undefined) {
        refuse(callId, invalidFrame(callId));
        return;
      }
      unanswered += 1;
      generation += 1;
      const mine = generation;
      const cancel = new AbortController();
      open.set(callId, { generation: mine, cancel });
      const deadline = frame.timeoutMs > 0 ? Date.now() + frame.timeoutMs : undefined;
      const caller = { peer, vouched: frame.metadata[CALLER_METADATA] };
      void this.#handleMessage(frame.message, deadline, cancel.signal, true, caller).then(
        (outcome) => {
          // The id is closed before the reply goes, so the caller may reuse it once the reply
          // arrives; only the call that opened the entry may close it.
          if (open.get(callId)?.generation === mine) {
            open.delete(callId);
          }
          answer(callId, outcome);
        },
      );
    });
    call.on("end", () => {
      inputEnded = true;
      finish();
    });
    call.once("cancelled", () => {
      // The caller went away: nobody reads the replies; stop every open call.
      gone = true;
      finished = true;
      closing.removeEventListener("abort", finish);
      for (const { cancel } of open.values()) {
        cancel.abort();
      }
    });
  };

  /**
   * HandleStream: the first message picks the stream handler; each reply answers the latest
   * message the handler has read. The stream counts as one message in flight while it lives
   * (it takes no concurrency slot, as in the Rust SDK).
   */
  readonly #serveStream: grpc.handleBidiStreamingCall<
    HandleStreamRequest | Undecodable,
    HandleStreamResponse
  > = (call) => {
    if (this.#closing.signal.aborted) {
      call.emit("error", this.#drainingError().toGrpcStatus());
      return;
    }
    const deadline = deadlineOf(call.getDeadline());
    const gone = new AbortController();
    const inbound = new AsyncQueue<ReachMessage>(64, () => call.resume());
    call.on("data", (request: HandleStreamRequest | Undecodable) => {
      if (request instanceof Undecodable) {
        inbound.fail(
          new ReachError(
            Code.INVALID_ARGUMENT,
            `a message on the stream could not be decoded (${request.why}); send HandleStreamRequests whose data nests at most ${MAX_DATA_DEPTH} levels (MAX_DATA_DEPTH)`,
          ),
        );
        return;
      }
      inbound.push(request.message ?? create(ReachMessageSchema));
      if (inbound.length >= inbound.highWater) {
        call.pause();
      }
    });
    call.on("end", () => inbound.end());
    call.once("cancelled", () => {
      gone.abort();
      inbound.fail(new ReachError(Code.CANCELLED, "the caller cancelled the stream"));
    });
    this.#enter();
    void this.#runStream(call, inbound, deadline, gone)
      .catch((error: unknown) => call.emit("error", ReachError.from(error).toGrpcStatus()))
      .finally(() => this.#exit());
  };

  async #runStream(
    call: grpc.ServerDuplexStream<HandleStreamRequest | Undecodable, HandleStreamResponse>,
    inbound: AsyncQueue<ReachMessage>,
    deadline: number | undefined,
    gone: AbortController,
  ): Promise<void> {
    const messages = inbound[Symbol.asyncIterator]();
    const opened = await messages.next();
    if (opened.done === true) {
      throw new ReachError(Code.INVALID_ARGUMENT, "the stream closed before its first message");
    }
    const first = opened.value;
    const handler = this.#pick(this.#streamHandlers, first);
    if (handler instanceof ReachError) {
      throw handler;
    }
    let timer: NodeJS.Timeout | undefined;
    if (deadline !== undefined) {
      timer = setTimeout(() => gone.abort(), timerDelay(deadline - Date.now()));
    }
    try {
      const metadata = new ReplyMetadata();
      const ctx = this.#context(
        first,
        deadline,
        gone.signal,
        metadata,
        this.#callerOf(call, firstValue(call.metadata, CALLER_METADATA)),
      );
      // Each reply answers the latest message the handler has read: the first, until it reads
      // another.
      let answering = first.header;
      const rest: AsyncIterable<ReachMessage> = {
        [Symbol.asyncIterator]: () => ({
          next: async () => {
            const next = await messages.next();
            if (next.done !== true && next.value.header !== undefined) {
              answering = next.value.header;
            }
            return next;
          },
        }),
      };
      try {
        for await (const payload of handler(ctx, first, rest)) {
          const outcome = this.#replyOutcome(answering, payload, metadata.take(), ctx.capability);
          if (outcome.error !== undefined) {
            throw outcome.error;
          }
          if (!call.write(create(HandleStreamResponseSchema, { message: outcome.reply }))) {
            // Flow control pushes back: wait for room, or stop when the caller has gone.
            await new Promise<void>((resolve) => {
              call.once("drain", resolve);
              gone.signal.addEventListener("abort", () => resolve(), { once: true });
            });
          }
          if (gone.signal.aborted) {
            return;
          }
        }
      } catch (error) {
        throw this.#handlerFailure(error, ctx.capability);
      }
      call.end();
    } finally {
      clearTimeout(timer);
    }
  }
}

/** Header metadata a handler adds to its reply, bounded (see `HandlerContext.setReplyMetadata`). */
class ReplyMetadata {
  #entries: Record<string, string> = {};

  set(key: string, value: string, logger: Logger): boolean {
    const keyBytes = Buffer.byteLength(key);
    if (keyBytes === 0 || keyBytes > MAX_REPLY_METADATA_KEY_BYTES) {
      logger.warn("reply metadata key empty or too long; dropped", {
        key_bytes: keyBytes,
        limit: MAX_REPLY_METADATA_KEY_BYTES,
      });
      return false;
    }
    const valueBytes = Buffer.byteLength(value);
    if (valueBytes > MAX_REPLY_METADATA_VALUE_BYTES) {
      logger.warn("reply metadata value too long; dropped", {
        key,
        value_bytes: valueBytes,
        limit: MAX_REPLY_METADATA_VALUE_BYTES,
      });
      return false;
    }
    if (
      !(key in this.#entries) &&
      Object.keys(this.#entries).length >= MAX_REPLY_METADATA_ENTRIES
    ) {
      logger.warn("too many reply metadata entries; dropped", {
        key,
        limit: MAX_REPLY_METADATA_ENTRIES,
      });
      return false;
    }
    this.#entries[key] = value;
    return true;
  }

  /** Takes the entries set so far, leaving none. */
  take(): Record<string, string> {
    const entries = this.#entries;
    this.#entries = {};
    return entries;
  }
}

/** A HandleMux or HandleStream request that could not be decoded, and why. */
class Undecodable {
  constructor(readonly why: string) {}
}

/**
 * AgentService's grpc-js definition, except that a HandleMux or HandleStream request that
 * cannot be decoded (bytes that are not the request, data nested past protobuf's recursion
 * limit) arrives as an {@link Undecodable}: grpc-js itself would end the stream INTERNAL at
 * once, dropping the answers of the calls it had read.
 */
function agentServiceDefinition(): grpc.ServiceDefinition {
  const definition = serviceDefinition(AgentService);
  const tolerant = (method: grpc.MethodDefinition<unknown, unknown>) => ({
    ...method,
    requestDeserialize: (bytes: Buffer) => {
      try {
        return method.requestDeserialize(bytes);
      } catch (error) {
        return new Undecodable(error instanceof Error ? error.message : String(error));
      }
    },
  });
  return {
    ...definition,
    handleMux: tolerant(definition.handleMux!),
    handleStream: tolerant(definition.handleStream!),
  };
}

/** What remembering `outcome` in the dedupe memory costs, bytes. */
function remembered(outcome: Outcome): number {
  const ENTRY_OVERHEAD_BYTES = 256;
  return (
    ENTRY_OVERHEAD_BYTES +
    (outcome.error === undefined
      ? toBinary(ReachMessageSchema, outcome.reply).length
      : outcome.error.statusMessage.length +
        (outcome.error.hasDetails ? outcome.error.encodeStatus().length : 0))
  );
}

function invalidFrame(callId: bigint): ReachError {
  return ReachError.of(
    Code.INVALID_ARGUMENT,
    `the frame for call_id ${callId} carries no message and is not a cancel (an empty frame?); send {"call_id": N, "message": {...}} to start a call or {"call_id": N, "cancel": true} to cancel one`,
    Reason.INVALID_FRAME,
    { call_id: String(callId) },
  );
}

/** A grpc-js deadline as ms since the epoch; `undefined` when there is none. */
function deadlineOf(deadline: grpc.Deadline): number | undefined {
  const ms = deadline instanceof Date ? deadline.getTime() : deadline;
  return Number.isFinite(ms) ? ms : undefined;
}

function listenError(listen: string, error: Error): Error {
  return new Error(
    `cannot listen on ${listen}: ${error.message}; choose another address with the listen option`,
    {
      cause: error,
    },
  );
}
