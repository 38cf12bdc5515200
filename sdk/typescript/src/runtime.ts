/**
 * {@link AgentRuntime}: serves `reach.v1.AgentService` around your handlers, registers with
 * the registry, keeps the lease alive and drains on shutdown — on the wire exactly as the
 * Rust SDK's `AgentRuntime` does.
 *
 * Lifecycle: bind → serve (AgentService and `grpc.health.v1`, SERVING for
 * `reach.v1.AgentService` and `""`) → register (REGISTERED; READY once the registry's health
 * probe passes) → heartbeat every third of the granted lease, reporting READY, or BUSY while
 * the messages in flight reach `maxConcurrency` → on drain: NOT_SERVING, report DRAINING,
 * refuse new messages with UNAVAILABLE / `INSTANCE_DRAINING` (the router redelivers them
 * elsewhere), let in-flight work finish for up to `maxDrainMs`, deregister, stop serving.
 *
 * The router delivers calls over `HandleMux` (many calls on one stream per router), falling
 * back to unary `Handle` for agents that do not serve it; routed streams arrive on
 * `HandleStream`. This runtime serves all three.
 *
 * @module
 */

import type { ReachError } from "./errors.js";
import type { MessageInitShape } from "@bufbuild/protobuf";

import { Agent, type Settings } from "./agent.js";
import { type CapabilitySpec, capabilityProto, checkCapability } from "./capability.js";
import type { Payload, PayloadSchema, ReachMessage } from "./gen/reach/v1/envelope_pb.js";
import type { Capability } from "./gen/reach/v1/registry_service_pb.js";
import { newMessageId } from "./ids.js";
import { type Logger, stderrLogger } from "./log.js";
import { parseEndpoint } from "./rpc.js";
import { DEFAULT_TRUST_DOMAIN, DirectCallers, readTls, type TlsOptions } from "./trust.js";

export {
  AGENT_SERVICE,
  FRAME_OVERHEAD_BYTES,
  MAX_CALL_METADATA_BYTES,
  MAX_OPEN_CALLS_PER_STREAM,
  MAX_REPLY_METADATA_ENTRIES,
  MAX_REPLY_METADATA_KEY_BYTES,
  MAX_REPLY_METADATA_VALUE_BYTES,
} from "./agent.js";

/** How an agent registers and behaves. Only `service` is required. */
export interface AgentOptions {
  /** The service name instances of this agent share (for example `executor.servicing`). */
  service: string;
  /** The registry to register with. Default `http://127.0.0.1:7070` (`reach dev`). */
  registry?: string | undefined;
  /** This instance's id. Default `<service>-<8 random hex digits>`. */
  instanceId?: string | undefined;
  /** Where to listen, `host:port`. Default `127.0.0.1:0` (a free port on loopback). */
  listen?: string | undefined;
  /** The host the router dials. Default the listen host (required for a wildcard one). */
  advertiseHost?: string | undefined;
  /** The protocol version this agent speaks. Default `1.0`. */
  protocolVersion?: string | undefined;
  /**
   * How many messages are handled at once; more wait for a slot (within their deadline), and
   * the router sends no more than this many at once (past it the router's admission queue
   * holds calls, then refuses them UNAVAILABLE / `OVERLOADED`). Default 8.
   */
  maxConcurrency?: number | undefined;
  /** The longest a drain waits for in-flight work, ms. Default 30 000. */
  maxDrainMs?: number | undefined;
  /** The lease TTL to ask for, ms; heartbeats go every third of the granted TTL. Default 10 000. */
  leaseTtlMs?: number | undefined;
  /** How long a handled message id is remembered (a redelivery gets the first reply), ms. Default 300 000. */
  dedupeWindowMs?: number | undefined;
  /** The most message ids remembered at once. Default 100 000. */
  dedupeCapacity?: number | undefined;
  /** The most bytes of remembered replies (encoded size); the oldest go first. Default 64 MiB. */
  dedupeMaxBytes?: number | undefined;
  /** The relative weight for weighted balancing. Default 1. */
  weight?: number | undefined;
  /** Topics to subscribe to (`MeshClient.publish` delivers to every subscriber). */
  topics?: string[] | undefined;
  /** Free-form labels shown by `reach agents`. */
  labels?: Record<string, string> | undefined;
  /** The largest message accepted or sent, bytes (encoded protobuf). Default 4 MiB. */
  maxMessageBytes?: number | undefined;
  /** Where log lines go. Default {@link stderrLogger}. */
  logger?: Logger | undefined;
  /**
   * The mesh's SPIFFE trust domain. Default `reach.local`. The router whose `x-reach-caller`
   * is believed is `spiffe://<trustDomain>/router`.
   */
  trustDomain?: string | undefined;
  /**
   * This agent's certificate (`spiffe://<trustDomain>/agent/<service>`), key and the mesh CA.
   * When set, the agent serves TLS requiring client certificates of the CA, registers over TLS
   * presenting its certificate (whatever the registry endpoint's scheme), and reads the caller
   * the router verified ({@link HandlerContext.caller}). With `ca` alone (an agent registering
   * with a {@link AgentOptions.joinToken} instead of a certificate) it registers over TLS but
   * serves plaintext, which only a router dialling instances in plaintext can reach. Default:
   * plaintext.
   */
  tls?: TlsOptions | undefined;
  /**
   * A join token (`reach token join`), sent as `authorization: Bearer` on Register only
   * (heartbeats authenticate with the lease), for an agent without a certificate of its
   * service. A one-time token registers once: an agent that must register again (after a
   * registry restart) needs a reusable one.
   */
  joinToken?: string | undefined;
  /**
   * When the agent serves TLS: the SPIFFE IDs that may call it (its AgentService and health)
   * and whose `x-reach-caller` is believed; every other peer is refused PERMISSION_DENIED /
   * `NOT_AUTHORIZED`, so the router's call policy cannot be skipped by dialling the agent
   * ({@link DirectCallers}). Default: `spiffe://<trustDomain>/router`.
   */
  routerIdentities?: readonly string[] | undefined;
  /**
   * When the agent serves TLS: the SPIFFE IDs that may call `grpc.health.v1` besides the
   * routers. Default: `spiffe://<trustDomain>/registry`, whose health probe makes an instance
   * READY.
   */
  probeIdentities?: readonly string[] | undefined;
}

/** What a handler knows about the message it handles. */
export interface HandlerContext {
  /** The message's W3C trace id (32 lowercase hex). */
  readonly traceId: string;
  /** The message's task id ("" when none). */
  readonly taskId: string;
  /** The message's id (the deduplication key). */
  readonly messageId: string;
  /**
   * The message's `header.turn`: agent hops its conversation has taken. A call made on its
   * behalf goes at `turn + 1` (`callOptionsWithin`); the router refuses turns above its
   * `max_turn` (FAILED_PRECONDITION, `TURN_LIMIT_EXCEEDED`).
   */
  readonly turn: number;
  /** The capability the message addressed ("" when it addressed the service). */
  readonly capability: string;
  /** When the caller stops waiting, ms since the epoch; `undefined` without a deadline. */
  readonly deadline: number | undefined;
  /**
   * Aborted when the caller goes away, cancels, or the deadline passes: long work should
   * watch it and stop.
   */
  readonly signal: AbortSignal;
  /** This instance's id. */
  readonly instanceId: string;
  /** Where an asynchronous reply goes ("" when the caller waits for the handler's return). */
  readonly replyTo: string;
  /**
   * The caller's SPIFFE ID as the router verified it (`spiffe://reach.local/operator/alice`,
   * `.../user/<sub>` for a bearer token's subject): the call's `x-reach-caller`, believed only
   * when the agent serves TLS ({@link AgentOptions.tls}) and the connection's client
   * certificate is the router's (`spiffe://<trustDomain>/router`); `undefined` otherwise (a
   * plaintext agent, a caller that dialled the agent directly, an anonymous caller).
   */
  readonly caller: string | undefined;
  /**
   * Adds `key` = `value` to the reply's `header.metadata` (setting a key again replaces it).
   * Bounded: at most {@link MAX_REPLY_METADATA_ENTRIES} entries, keys of at most
   * {@link MAX_REPLY_METADATA_KEY_BYTES} bytes, values of at most
   * {@link MAX_REPLY_METADATA_VALUE_BYTES}; an entry past a bound is dropped with a warning.
   * On a stream, entries set since the previous reply go with the next one.
   *
   * @returns whether the entry was kept.
   */
  setReplyMetadata(key: string, value: string): boolean;
}

/** A reply payload: a `Payload` (see `makePayload`) or its init shape `{ type, parts }`. */
export type PayloadInit = Payload | MessageInitShape<typeof PayloadSchema>;

/**
 * Handles one message and returns the reply payload; the runtime wraps it in an envelope
 * that answers the request (same trace and task, `correlation_id` = the request's id).
 * Throw a {@link ReachError} to answer with its status — except that one with a reason meaning
 * "not delivered" (`ROUTE_NOT_FOUND`, `INSTANCE_DRAINING`, `OVERLOADED`,
 * `INSTANCE_UNAVAILABLE`: a call the handler made failed) answers FAILED_PRECONDITION,
 * `a call this handler made failed: ...`; anything else thrown answers INTERNAL with its
 * message. A reply that cannot be sent (data deeper than `MAX_DATA_DEPTH`, which `dataPart`
 * throws for) answers INTERNAL.
 */
export type Handler = (
  ctx: HandlerContext,
  message: ReachMessage,
) => PayloadInit | Promise<PayloadInit>;

/**
 * Handles a bidirectional stream: reads the caller's messages (`first` opened it, `rest`
 * follows until the caller half-closes) and yields reply payloads. Returning ends the stream
 * OK; throwing ends it with that status, as a {@link Handler}'s (after the payloads already
 * yielded).
 */
export type StreamHandler = (
  ctx: HandlerContext,
  first: ReachMessage,
  rest: AsyncIterable<ReachMessage>,
) => AsyncIterable<PayloadInit>;

/** An agent process: handlers by capability, served and registered. */
export class AgentRuntime {
  readonly #settings: Settings;
  readonly #handlers = new Map<string, Handler>();
  readonly #streamHandlers = new Map<string, StreamHandler>();
  readonly #capabilities: Capability[] = [];

  /**
   * A runtime with no handlers yet.
   *
   * @throws {TypeError} naming the option when `options` is invalid.
   */
  constructor(options: AgentOptions) {
    this.#settings = settingsOf(options);
  }

  /**
   * Serves unary messages for `capability` with `handler`, registering its version,
   * description and schemas.
   *
   * @throws {TypeError} when the description or a schema is out of the registry's bounds.
   */
  handle(capability: CapabilitySpec, handler: Handler): this {
    this.#declare(capability);
    this.#handlers.set(capability.name, handler);
    return this;
  }

  /**
   * Serves streams (`MeshClient.stream`) for `capability` with `handler`, registering it as
   * {@link AgentRuntime.handle} does. A unary and a stream handler may share a capability.
   *
   * @throws {TypeError} when the description or a schema is out of the registry's bounds.
   */
  handleStream(capability: CapabilitySpec, handler: StreamHandler): this {
    this.#declare(capability);
    this.#streamHandlers.set(capability.name, handler);
    return this;
  }

  /**
   * Starts serving and registering; resolves once the server listens (registration goes on
   * in the background, retried while the registry is unreachable).
   *
   * @throws {Error} when the listen address cannot be bound.
   */
  async start(): Promise<RunningAgent> {
    const agent = new Agent(
      this.#settings,
      new Map(this.#handlers),
      new Map(this.#streamHandlers),
      [...this.#capabilities],
    );
    await agent.serve();
    return new RunningAgent(agent);
  }

  /**
   * Starts, serves until SIGTERM or SIGINT, then drains and resolves once the instance has
   * left the mesh. A second signal during the drain exits the process at once. Rejects (after
   * draining) when the registry refuses the registration for good
   * ({@link RunningAgent.registrationRefused}).
   */
  async run(): Promise<void> {
    const running = await this.start();
    let stop = () => {};
    const signalled = new Promise<undefined>((resolve) => {
      stop = () => resolve(undefined);
      process.once("SIGTERM", stop);
      process.once("SIGINT", stop);
    });
    const refused = await Promise.race([signalled, running.registrationRefused()]);
    process.off("SIGTERM", stop);
    process.off("SIGINT", stop);
    const exitNow = (signal: NodeJS.Signals) => process.exit(signal === "SIGINT" ? 130 : 143);
    process.once("SIGTERM", exitNow);
    process.once("SIGINT", exitNow);
    try {
      await running.drain();
    } finally {
      process.off("SIGTERM", exitNow);
      process.off("SIGINT", exitNow);
    }
    if (refused !== undefined) {
      throw new Error(
        `the registry refused this agent's registration: ${refused.message}; it cannot succeed as configured: fix what it names and start the agent again`,
        { cause: refused },
      );
    }
  }

  /**
   * Declares `spec` once: a unary and a stream handler of one name share it, the first
   * declaration's version stays, and a later one's description and schemas fill in.
   */
  #declare(spec: CapabilitySpec): void {
    const problem = checkCapability(spec);
    if (problem !== undefined) {
      throw new TypeError(problem);
    }
    const declared = capabilityProto(spec);
    const existing = this.#capabilities.find((c) => c.name === declared.name);
    if (existing === undefined) {
      this.#capabilities.push(declared);
      return;
    }
    existing.description = declared.description || existing.description;
    existing.inputSchema = declared.inputSchema || existing.inputSchema;
    existing.outputSchema = declared.outputSchema || existing.outputSchema;
  }
}

/** A started agent: its endpoint and load, and {@link RunningAgent.drain} to take it out. */
export class RunningAgent {
  readonly #agent: Agent;

  /** @internal Made by {@link AgentRuntime.start}. */
  constructor(agent: Agent) {
    this.#agent = agent;
  }

  /** This instance's id. */
  get instanceId(): string {
    return this.#agent.settings.instanceId;
  }

  /** The URL the router dials (`http://127.0.0.1:PORT`). */
  get endpoint(): string {
    return this.#agent.endpoint;
  }

  /** Messages and streams being handled now. */
  get inFlight(): number {
    return this.#agent.inFlight;
  }

  /** How many `HandleMux` streams callers (routers) opened to this instance; for diagnostics and tests. */
  get muxStreamsOpened(): number {
    return this.#agent.muxStreamsOpened;
  }

  /**
   * Resolves, with the registry's error, once the registry refused the registration for good
   * (INVALID_ARGUMENT or FAILED_PRECONDITION: a bad name, version or descriptor, an undeclared
   * capability, an instance an operator drained; PERMISSION_DENIED or UNAUTHENTICATED: the
   * certificate or join token does not allow it, the token is expired or used); stays pending while the registration stands
   * or is being retried. {@link AgentRuntime.run} drains and throws then.
   */
  registrationRefused(): Promise<ReachError> {
    return this.#agent.refused;
  }

  /**
   * Drains: NOT_SERVING, reports DRAINING, refuses new messages, waits up to `maxDrainMs` for
   * in-flight work, deregisters and stops serving. Calling it again returns the same drain.
   */
  drain(): Promise<void> {
    return this.#agent.drain();
  }
}

/** The options with defaults filled in, checked. */
function settingsOf(options: AgentOptions): Settings {
  const fail = (message: string): never => {
    throw new TypeError(message);
  };
  if (!options.service) {
    fail('service must be set (for example "executor.servicing")');
  }
  const positive = (name: string, value: number | undefined, fallback: number): number => {
    const n = value ?? fallback;
    if (!Number.isSafeInteger(n) || n < 1) {
      fail(`${name} must be a whole number of at least 1, got ${String(value)}`);
    }
    return n;
  };
  const listen = options.listen ?? "127.0.0.1:0";
  const colon = listen.lastIndexOf(":");
  if (colon <= 0) {
    fail(`listen ${JSON.stringify(listen)} must be host:port (for example 127.0.0.1:0)`);
  }
  const listenHost = listen.slice(0, colon).replace(/^\[(.*)\]$/, "$1");
  const advertiseHost = options.advertiseHost ?? listenHost;
  if (["0.0.0.0", "::", ""].includes(advertiseHost)) {
    fail(
      `listen ${JSON.stringify(listen)} is a wildcard address; set advertiseHost to the address the router should dial`,
    );
  }
  const registry = options.registry ?? "http://127.0.0.1:7070";
  parseEndpoint(registry);
  const maxDrainMs = options.maxDrainMs ?? 30_000;
  if (!Number.isFinite(maxDrainMs) || maxDrainMs < 0) {
    fail(
      `maxDrainMs must be a number of milliseconds of at least 0, got ${String(options.maxDrainMs)}`,
    );
  }
  const dedupeMaxBytes = options.dedupeMaxBytes ?? 64 * 1024 * 1024;
  if (!Number.isSafeInteger(dedupeMaxBytes) || dedupeMaxBytes < 0) {
    fail(
      `dedupeMaxBytes must be a whole number of at least 0, got ${String(options.dedupeMaxBytes)}`,
    );
  }
  const trustDomain = options.trustDomain ?? DEFAULT_TRUST_DOMAIN;
  if (!/^[A-Za-z0-9._-]+$/.test(trustDomain)) {
    fail(
      `trustDomain ${JSON.stringify(trustDomain)} must be a DNS-like name (for example "reach.local")`,
    );
  }
  const tls = options.tls === undefined ? undefined : readTls(options.tls, "tls");
  const joinToken = options.joinToken?.trim() ?? "";
  if (!/^[!-~]*$/.test(joinToken)) {
    fail("joinToken is not a valid token (it must be printable ASCII)");
  }
  const callers = DirectCallers.of(
    trustDomain,
    options.routerIdentities ?? [],
    options.probeIdentities ?? [],
  );
  return {
    service: options.service,
    registry,
    instanceId: options.instanceId ?? `${options.service}-${newMessageId().slice(-8)}`,
    listen,
    advertiseHost,
    protocolVersion: options.protocolVersion ?? "1.0",
    maxConcurrency: positive("maxConcurrency", options.maxConcurrency, 8),
    maxDrainMs,
    leaseTtlMs: positive("leaseTtlMs", options.leaseTtlMs, 10_000),
    dedupeWindowMs: positive("dedupeWindowMs", options.dedupeWindowMs, 300_000),
    dedupeCapacity: positive("dedupeCapacity", options.dedupeCapacity, 100_000),
    dedupeMaxBytes,
    weight: positive("weight", options.weight, 1),
    topics: [...(options.topics ?? [])],
    labels: { ...options.labels },
    maxMessageBytes: positive("maxMessageBytes", options.maxMessageBytes, 4 * 1024 * 1024),
    logger: options.logger ?? stderrLogger,
    trustDomain,
    tls,
    joinToken,
    callers,
  };
}
