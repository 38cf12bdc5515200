/**
 * {@link MeshClient}: calls, streams and publishes through the router, addressing
 * capabilities or services, and starts, reads and resumes orchestrator tasks. Messages are
 * stamped at the edge as the Rust SDK's `MeshClient` stamps them: a fresh UUIDv7 message id,
 * a fresh W3C trace id unless the call continues a trace, `source`, protocol version `1.0`,
 * `created_at`; each call carries a `traceparent` naming that trace. A message whose data nests
 * deeper than {@link MAX_DATA_DEPTH} is refused before anything is sent.
 *
 * @module
 */

import { create, type JsonObject, type JsonValue, toBinary } from "@bufbuild/protobuf";
import { timestampNow } from "@bufbuild/protobuf/wkt";
import type * as grpc from "@grpc/grpc-js";

import { Code, Reason, ReachError } from "./errors.js";
import { type Payload, type ReachMessage, ReachMessageSchema } from "./gen/reach/v1/envelope_pb.js";
import { OrchestratorService, type Task } from "./gen/reach/v1/orchestrator_service_pb.js";
import {
  type PublishResponse,
  type RouteInfo,
  RouterService,
  type StreamRequest,
  type StreamResponse,
  StreamRequestSchema,
} from "./gen/reach/v1/router_service_pb.js";
import { isTraceId, newMessageId, newTraceId, TRACEPARENT, traceparentFor } from "./ids.js";
import { firstData, MAX_DATA_DEPTH, makePayload, tooDeepPart, valueOf } from "./parts.js";
import type { HandlerContext } from "./runtime.js";
import { CallMuxLink, UNSUPPORTED } from "./mux.js";
import { RpcChannel } from "./rpc.js";
import { readTls, type TlsOptions } from "./trust.js";
import { AsyncQueue } from "./sync.js";

/**
 * The largest message the client sends or accepts (bytes); the router enforces its own,
 * usually smaller, limit with RESOURCE_EXHAUSTED / `PAYLOAD_TOO_LARGE`.
 */
const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

/**
 * The largest message (encoded, bytes) a multiplexed client sends as a CallMux frame: the
 * router's default `max_message_bytes`. A larger one goes as a unary `Call`: as a frame above
 * the router's transport limit it would end the stream every concurrent call shares, where a
 * unary `Call` is refused (RESOURCE_EXHAUSTED / `PAYLOAD_TOO_LARGE`) alone.
 */
export const MUX_MAX_MESSAGE_BYTES = 4 * 1024 * 1024;

/** The response metadata the router sets on a routed stream. */
const TRACE_ID_METADATA = "x-reach-trace-id";
const INSTANCE_ID_METADATA = "x-reach-instance-id";

/** Options of one call, stream or publish. */
export interface CallOptions {
  /** The deadline in milliseconds from now, sent as `grpc-timeout`; router and agent enforce it. */
  timeoutMs?: number | undefined;
  /** The trace to continue (32 lowercase hex); unset starts a new trace. */
  traceId?: string | undefined;
  /** The task the message belongs to. */
  taskId?: string | undefined;
  /** A semver requirement on the capability version (for example `^1.2`). */
  capabilityVersion?: string | undefined;
  /**
   * The message id; unset assigns a fresh UUIDv7. Set it to make a retry of the same logical
   * message deduplicated by the receiving agent.
   */
  messageId?: string | undefined;
  /**
   * The message's `header.turn` (agent hops so far); unset sends 0. The router refuses turns
   * above its `max_turn` (FAILED_PRECONDITION, `TURN_LIMIT_EXCEEDED`).
   */
  turn?: number | undefined;
  /** Cancels the call when aborted (it fails with CANCELLED). */
  signal?: AbortSignal | undefined;
  /**
   * Ask for an asynchronous reply: the handler may answer at once with {@link ackPayload}
   * and send the answer later with {@link MeshClient.reply}; the router holds the call until
   * then (within the deadline and its `max_async_wait`).
   */
  asyncReply?: boolean | undefined;
}

/** The payload type of an acknowledgement (the Rust SDK's `ACK_PAYLOAD_TYPE`). */
export const ACK_PAYLOAD_TYPE = "reach.ack";

/**
 * The acknowledgement payload: a handler of a call that asked for an asynchronous reply
 * (`ctx.replyTo` set) returns it at once and answers later with {@link MeshClient.reply}.
 */
export function ackPayload(): Payload {
  return makePayload(ACK_PAYLOAD_TYPE);
}

/**
 * Options for a call a handler makes on behalf of the message `ctx` describes: the same
 * trace and task, `turn` = `ctx.turn + 1`, and a timeout of what is left of `ctx`'s deadline
 * (0 once it has passed; none when `ctx` has none), cancelled with the handler's call.
 */
export function callOptionsWithin(ctx: HandlerContext): CallOptions {
  return {
    timeoutMs: ctx.deadline === undefined ? undefined : Math.max(0, ctx.deadline - Date.now()),
    traceId: ctx.traceId || undefined,
    taskId: ctx.taskId || undefined,
    turn: ctx.turn + 1,
    signal: ctx.signal,
  };
}

/** A call's reply and where the router delivered it. */
export interface CallResult {
  /** The instance's reply; its `header.correlationId` is the request's message id. */
  message: ReachMessage;
  /** The instance, service, trace id and message id of the delivery. */
  route: RouteInfo | undefined;
  /** The reply's first data part as a plain object (`firstData`), if it has one. */
  data: JsonObject | undefined;
}

/** Options of a {@link MeshClient}. */
export interface MeshClientOptions {
  /** The sending service, dotted (for example `ingest.main`): every message's `header.source`. */
  source: string;
  /** The router. Default `http://127.0.0.1:7070` (`reach dev`). */
  router?: string | undefined;
  /** The orchestrator. Default the router's endpoint (`reach dev` serves both on one port). */
  orchestrator?: string | undefined;
  /**
   * Send calls as frames on one multiplexed `RouterService.CallMux` stream, as the Rust
   * client does (falling back to unary `Call` for a router that does not serve it), instead
   * of one unary `Call` each. Default false. The open stream keeps the process alive until
   * {@link MeshClient.close}.
   */
  multiplex?: boolean | undefined;
  /**
   * For a mesh serving TLS: the CA to trust and, optionally, a certificate to present
   * (`cert`/`key` may stay unset where the mesh allows callers without one). Used for every
   * endpoint, whatever its scheme. Default: plaintext (or, for `https://`, TLS with the
   * system's roots).
   */
  tls?: TlsOptions | undefined;
  /**
   * A bearer token (`reach token operator`, an identity provider's JWT) sent as
   * `authorization: Bearer <token>` on every call; the router verifies it and names the caller
   * to agents. Send it over TLS (or to a loopback endpoint) only.
   */
  token?: string | undefined;
}

/** Options of {@link MeshClient.startTask}. */
export interface StartTaskOptions {
  /** A client-chosen task id (1 to 128 of `A-Za-z0-9._:-`); starting an existing id returns that task. */
  taskId?: string | undefined;
  /** The flow version to run; unset or 0 runs the latest. */
  flowVersion?: number | undefined;
  /** The deadline in milliseconds from now. */
  timeoutMs?: number | undefined;
}

/**
 * A client of the mesh: every call goes through a router, addressed by capability or
 * service. One HTTP/2 connection per endpoint, opened on first use; {@link MeshClient.close}
 * closes them.
 */
export class MeshClient {
  readonly source: string;
  readonly #router: RpcChannel;
  readonly #orchestrator: RpcChannel;
  readonly #mux: CallMuxLink | undefined;

  /** @throws {TypeError} when an endpoint is not an `http://host:port` URL or `source` is empty. */
  constructor(options: MeshClientOptions) {
    if (!options.source) {
      throw new TypeError(
        'source must be set: the sending service, dotted (for example "ingest.main")',
      );
    }
    this.source = options.source;
    const router = options.router ?? "http://127.0.0.1:7070";
    const security = {
      tls: options.tls === undefined ? undefined : readTls(options.tls, "tls"),
      token: options.token,
    };
    this.#router = new RpcChannel(router, MAX_MESSAGE_BYTES, security);
    this.#orchestrator =
      options.orchestrator === undefined || options.orchestrator === router
        ? this.#router
        : new RpcChannel(options.orchestrator, MAX_MESSAGE_BYTES, security);
    this.#mux = options.multiplex === true ? new CallMuxLink(this.#router) : undefined;
  }

  /**
   * How many CallMux streams this client opened to the router: 1 while the first lives, more
   * after reconnects, 0 when calls go unary (`multiplex` off, or a router without CallMux).
   * For diagnostics and tests.
   */
  get muxStreamsOpened(): number {
    return this.#mux?.streamsOpened ?? 0;
  }

  /**
   * A message to `target` carrying `payload`, stamped as every message from this client is
   * (see the module docs).
   */
  message(
    target: { capability: string } | { service: string } | { topic: string },
    payload: Payload,
    options: CallOptions = {},
  ): ReachMessage {
    const header = {
      messageId: options.messageId ?? newMessageId(),
      traceId: options.traceId ?? newTraceId(),
      taskId: options.taskId ?? "",
      source: this.source,
      capabilityVersion: options.capabilityVersion ?? "",
      protocolVersion: "1.0",
      createdAt: timestampNow(),
      turn: options.turn ?? 0,
      // Any value asks; the router puts its own address here.
      replyTo: options.asyncReply === true ? "async" : "",
    };
    const addressed =
      "capability" in target
        ? { case: "capability" as const, value: target.capability }
        : "service" in target
          ? { case: "service" as const, value: target.service }
          : { case: "topic" as const, value: target.topic };
    return create(ReachMessageSchema, { header: { ...header, target: addressed }, payload });
  }

  /**
   * Calls `capability` with `payload` and resolves to the reply and where it was handled.
   *
   * @throws {ReachError} the router's or the agent's status: NOT_FOUND / `ROUTE_NOT_FOUND`,
   * DEADLINE_EXCEEDED, UNAVAILABLE / `OVERLOADED` (with `retryAfterMs`), the handler's own.
   */
  call(capability: string, payload: Payload, options: CallOptions = {}): Promise<CallResult> {
    return this.send(this.message({ capability }, payload, options), options);
  }

  /** Calls any instance of `service` with `payload`; see {@link MeshClient.call}. */
  callService(service: string, payload: Payload, options: CallOptions = {}): Promise<CallResult> {
    return this.send(this.message({ service }, payload, options), options);
  }

  /**
   * Sends a prepared message (see {@link MeshClient.message}) through the router — a CallMux
   * frame with `multiplex` (unless it is larger than {@link MUX_MAX_MESSAGE_BYTES}), else a
   * unary `Call` — with a `traceparent` naming its trace.
   *
   * @throws {ReachError} as {@link MeshClient.call}; INVALID_ARGUMENT / `INVALID_PAYLOAD`
   * (metadata `depth`, `limit`), without sending, when a data part nests deeper than
   * {@link MAX_DATA_DEPTH}; with `multiplex` also INVALID_ARGUMENT / `INVALID_PAYLOAD`, without
   * sending, when the message cannot be encoded (a field out of range), and UNAVAILABLE when the
   * stream to the router broke while the call was in flight (it may have been handled: resend
   * with the same `message_id`).
   */
  async send(
    message: ReachMessage,
    options: Pick<CallOptions, "timeoutMs" | "signal"> = {},
  ): Promise<CallResult> {
    const tooDeep = tooDeepPart(message.payload);
    if (tooDeep !== undefined) {
      throw ReachError.of(
        Code.INVALID_ARGUMENT,
        `payload.parts[${tooDeep.part}] nests ${tooDeep.depth} levels deep, over the limit of ${MAX_DATA_DEPTH}; flatten the data (each object or array is one level)`,
        Reason.INVALID_PAYLOAD,
        { depth: String(tooDeep.depth), limit: String(MAX_DATA_DEPTH) },
      );
    }
    const settings = {
      timeoutMs: options.timeoutMs,
      signal: options.signal,
      metadata: traceMetadata(message),
    };
    if (this.#mux !== undefined && encodedSize(message) <= MUX_MAX_MESSAGE_BYTES) {
      const response = await this.#mux.call(message, settings);
      if (response !== UNSUPPORTED) {
        const frame = response.frame?.result;
        if (frame?.case === "reply") {
          return {
            message: frame.value,
            route: response.route,
            data: firstData(frame.value.payload),
          };
        }
        if (frame?.case === "error") {
          throw ReachError.fromStatus(frame.value.code, frame.value.message, frame.value.details);
        }
        throw new ReachError(
          Code.INTERNAL,
          "the router sent a reply frame with neither a reply nor an error",
        );
      }
    }
    const response = await this.#router.unary(RouterService.method.call, { message }, settings);
    const reply = response.message ?? create(ReachMessageSchema);
    return { message: reply, route: response.route, data: firstData(reply.payload) };
  }

  /**
   * Publishes `payload` to every routable subscriber of `topic`; resolves to the counts of
   * deliveries and failures.
   *
   * @throws {ReachError} the router's status (NOT_FOUND / `ROUTE_NOT_FOUND` when nobody
   * subscribes, INVALID_ARGUMENT / `INVALID_HEADER` for an empty topic).
   */
  publish(topic: string, payload: Payload, options: CallOptions = {}): Promise<PublishResponse> {
    const message = this.message({ topic }, payload, options);
    return this.#router.unary(
      RouterService.method.publish,
      { message },
      { timeoutMs: options.timeoutMs, signal: options.signal, metadata: traceMetadata(message) },
    );
  }

  /**
   * Sends the asynchronous answer to the request `ctx` describes (a handler that returned
   * {@link ackPayload}). Any router replica takes it and hands it to the replica whose caller
   * waits; resolves to whether a caller was still waiting.
   *
   * @throws {ReachError} INVALID_ARGUMENT when the request asked for no asynchronous reply;
   * the router's status otherwise.
   */
  async reply(
    ctx: HandlerContext,
    payload: Payload,
    options: Pick<CallOptions, "timeoutMs"> = {},
  ): Promise<boolean> {
    if (ctx.replyTo === "") {
      throw new ReachError(
        Code.INVALID_ARGUMENT,
        "the request carried no reply_to; return the answer from the handler instead",
      );
    }
    const message = create(ReachMessageSchema, {
      header: {
        messageId: newMessageId(),
        traceId: ctx.traceId,
        taskId: ctx.taskId,
        source: this.source,
        correlationId: ctx.messageId,
        protocolVersion: "1.0",
        createdAt: timestampNow(),
      },
      payload,
    });
    const response = await this.#router.unary(
      RouterService.method.reply,
      { message, replyTo: ctx.replyTo },
      { timeoutMs: options.timeoutMs, metadata: traceMetadata(message) },
    );
    return response.delivered;
  }

  /**
   * Opens a stream through the router's `Stream` to one instance of `capability` (chosen by
   * the first message). Send payloads with {@link MeshStream.send}, half-close with
   * {@link MeshStream.end}, read the replies by iterating it.
   */
  stream(capability: string, options: CallOptions = {}): MeshStream {
    return new MeshStream(this, this.#router, { capability }, options);
  }

  /** Opens a stream to any instance of `service`; see {@link MeshClient.stream}. */
  streamService(service: string, options: CallOptions = {}): MeshStream {
    return new MeshStream(this, this.#router, { service }, options);
  }

  /**
   * Starts a task of flow `flowId` with `input` (visible to the flow's expressions as
   * `input`). The orchestrator gives the task its own trace id (`task.traceId`): every
   * message of the task carries it.
   *
   * @throws {ReachError} NOT_FOUND / `FLOW_NOT_FOUND`, INVALID_ARGUMENT / `INVALID_TASK_ID`,
   * ALREADY_EXISTS / `TASK_ID_IN_USE`, UNAVAILABLE / `STORE_UNAVAILABLE`.
   */
  async startTask(flowId: string, input: JsonValue, options: StartTaskOptions = {}): Promise<Task> {
    const response = await this.#orchestrator.unary(
      OrchestratorService.method.startTask,
      {
        flowId,
        flowVersion: options.flowVersion ?? 0,
        input: valueOf(input),
        taskId: options.taskId ?? "",
      },
      { timeoutMs: options.timeoutMs, metadata: { [TRACEPARENT]: traceparentFor(newTraceId()) } },
    );
    return taskOf(response.task, flowId);
  }

  /**
   * The task `taskId` with its node history (inputs and outputs masked); read its status,
   * `waiting` (what a human node needs) and `output` (`jsonOf(task.output)`).
   *
   * @throws {ReachError} NOT_FOUND / `TASK_NOT_FOUND`.
   */
  async getTask(taskId: string, options: { timeoutMs?: number | undefined } = {}): Promise<Task> {
    const response = await this.#orchestrator.unary(
      OrchestratorService.method.getTask,
      { taskId },
      { timeoutMs: options.timeoutMs },
    );
    return taskOf(response.task, taskId);
  }

  /**
   * Gives a person's `input` to task `taskId`, waiting in a `human` node (`options.nodeId`
   * names the node; unset: the one it waits in); resolves to the task as it is then.
   *
   * @throws {ReachError} FAILED_PRECONDITION / `TASK_NOT_WAITING` or `NODE_NOT_WAITING`,
   * INVALID_ARGUMENT / `INVALID_INPUT` (with `violations`), NOT_FOUND / `TASK_NOT_FOUND`.
   */
  async resumeTask(
    taskId: string,
    input: JsonValue,
    options: { nodeId?: string | undefined; timeoutMs?: number | undefined } = {},
  ): Promise<Task> {
    const response = await this.#orchestrator.unary(
      OrchestratorService.method.resumeTask,
      { taskId, nodeId: options.nodeId ?? "", input: valueOf(input) },
      { timeoutMs: options.timeoutMs },
    );
    return taskOf(response.task, taskId);
  }

  /** Closes the client's connections; calls in flight fail with CANCELLED or UNAVAILABLE. */
  close(): void {
    this.#mux?.close();
    this.#router.close();
    if (this.#orchestrator !== this.#router) {
      this.#orchestrator.close();
    }
  }
}

/** The instance a routed stream was delivered to, and its trace. */
export interface StreamRoute {
  /** The instance the router chose. */
  instanceId: string;
  /** The stream's trace id. */
  traceId: string;
}

/**
 * A stream through the router to one instance. The first {@link MeshStream.send} picks the
 * instance (by its target); later messages go to the same instance, on the same trace.
 * Iterate it for the instance's replies; the iteration throws the stream's failure as a
 * {@link ReachError}.
 */
export class MeshStream implements AsyncIterable<ReachMessage> {
  readonly #client: MeshClient;
  readonly #target: { capability: string } | { service: string };
  readonly #options: CallOptions;
  readonly #traceId: string;
  readonly #call: grpc.ClientDuplexStream<StreamRequest, StreamResponse>;
  readonly #replies: AsyncQueue<ReachMessage>;
  #sent = 0;
  /**
   * Where the router delivered the stream (its `x-reach-instance-id` and `x-reach-trace-id`
   * response headers); `undefined` when the stream ended without headers (refused at once).
   */
  readonly route: Promise<StreamRoute | undefined>;

  /** @internal Made by {@link MeshClient.stream}. */
  constructor(
    client: MeshClient,
    router: RpcChannel,
    target: { capability: string } | { service: string },
    options: CallOptions,
  ) {
    this.#client = client;
    this.#target = target;
    this.#options = options;
    this.#traceId = options.traceId ?? newTraceId();
    this.#call = router.bidi(RouterService.method.stream, {
      timeoutMs: options.timeoutMs,
      signal: options.signal,
      metadata: isTraceId(this.#traceId) ? { [TRACEPARENT]: traceparentFor(this.#traceId) } : {},
    });
    const call = this.#call;
    this.#replies = new AsyncQueue<ReachMessage>(64, () => call.resume());
    let resolveRoute: (route: StreamRoute | undefined) => void = () => {};
    this.route = new Promise((resolve) => (resolveRoute = resolve));
    call.once("metadata", (metadata: grpc.Metadata) => {
      const text = (key: string) => {
        const [value] = metadata.get(key);
        return typeof value === "string" ? value : "";
      };
      resolveRoute({ instanceId: text(INSTANCE_ID_METADATA), traceId: text(TRACE_ID_METADATA) });
    });
    call.on("data", (response: StreamResponse) => {
      this.#replies.push(response.message ?? create(ReachMessageSchema));
      if (this.#replies.length >= this.#replies.highWater) {
        call.pause();
      }
    });
    // The stream is over once every reply has been read ("end") and its status has arrived
    // ("error" then "status" for a failure, "status" alone for OK); replies sent before a
    // failure are read first.
    let ended = false;
    let outcome: { failure?: ReachError } | undefined;
    const settle = () => {
      if (!ended || outcome === undefined) {
        return;
      }
      resolveRoute(undefined);
      if (outcome.failure === undefined) {
        this.#replies.end();
      } else {
        this.#replies.fail(outcome.failure);
      }
    };
    call.on("error", (error: unknown) => {
      outcome = { failure: ReachError.from(error) };
      settle();
    });
    call.on("status", (status: grpc.StatusObject) => {
      outcome ??=
        status.code === Code.OK
          ? {}
          : { failure: ReachError.fromStatus(status.code, status.details) };
      settle();
    });
    call.on("end", () => {
      ended = true;
      settle();
    });
  }

  /** The stream's trace id: every message sent on it carries it. */
  get traceId(): string {
    return this.#traceId;
  }

  /**
   * Sends `payload` as the next message (the first carries the target). Resolves once the
   * transport took it (waits while HTTP/2 flow control pushes back).
   */
  send(payload: Payload): Promise<void> {
    const first = this.#sent === 0;
    this.#sent += 1;
    const options = { ...this.#options, traceId: this.#traceId, messageId: undefined };
    const message = this.#client.message(this.#target, payload, options);
    if (!first && message.header !== undefined) {
      message.header.target = { case: undefined };
    }
    return new Promise((resolve, reject) => {
      this.#call.write(
        create(StreamRequestSchema, { message }),
        (error: Error | null | undefined) => (error ? reject(ReachError.from(error)) : resolve()),
      );
    });
  }

  /** Half-closes: the instance sees the end of the caller's messages; replies keep coming. */
  end(): void {
    this.#call.end();
  }

  /** Cancels the stream: both directions stop, and the iteration throws CANCELLED. */
  cancel(): void {
    this.#call.cancel();
  }

  [Symbol.asyncIterator](): AsyncIterator<ReachMessage> {
    return this.#replies[Symbol.asyncIterator]();
  }
}

/**
 * The encoded size of `message`, bytes. Encoding it before it goes on the shared stream keeps a
 * message that cannot be encoded from failing the stream (grpc-js cancels a stream whose
 * message fails to serialize).
 *
 * @throws {ReachError} INVALID_ARGUMENT / `INVALID_PAYLOAD` when it cannot be encoded.
 */
function encodedSize(message: ReachMessage): number {
  try {
    return toBinary(ReachMessageSchema, message).length;
  } catch (error) {
    throw ReachError.of(
      Code.INVALID_ARGUMENT,
      `the message cannot be encoded (${error instanceof Error ? error.message : String(error)}); nothing was sent`,
      Reason.INVALID_PAYLOAD,
    );
  }
}

/**
 * The `traceparent` of `message`'s trace; none for a malformed trace id, which the router
 * refuses (INVALID_ARGUMENT / `INVALID_TRACE_ID`).
 */
function traceMetadata(message: ReachMessage): Record<string, string> {
  const traceId = message.header?.traceId ?? "";
  return isTraceId(traceId) ? { [TRACEPARENT]: traceparentFor(traceId) } : {};
}

function taskOf(task: Task | undefined, id: string): Task {
  if (task === undefined) {
    throw new ReachError(
      Code.INTERNAL,
      `the orchestrator answered without a task for ${JSON.stringify(id)}`,
    );
  }
  return task;
}
