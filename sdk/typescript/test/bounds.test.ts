/**
 * What must fail alone, and how, on a real `reach dev` (no example agents): an undecodable
 * HandleMux frame ends its stream INVALID_ARGUMENT / `INVALID_FRAME` once the calls read are
 * answered; a reply that cannot be sent (data deeper than `MAX_DATA_DEPTH`) fails its call
 * INTERNAL while the shared streams go on; data at the limit goes through CallMux and HandleMux
 * and deeper data is refused before it is sent; an oversized or unencodable call fails alone
 * on a multiplexed client; a nested call's delivery reason is not forwarded as the handler's own.
 */

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { create, fromBinary, type JsonValue, toBinary } from "@bufbuild/protobuf";
import * as grpc from "@grpc/grpc-js";

import {
  AgentRuntime,
  callOptionsWithin,
  Code,
  DataTooDeepError,
  dataPart,
  InstanceState,
  type Logger,
  makePayload,
  MAX_DATA_DEPTH,
  MeshClient,
  Reason,
  ReachError,
  RpcChannel,
  type RunningAgent,
  textPart,
  valueOf,
} from "@reach-mesh/sdk";
import {
  AgentService,
  HandleMuxRequestSchema,
  HandleMuxResponseSchema,
} from "@reach-mesh/sdk/gen/reach/v1/agent_service_pb.js";
import { PartSchema } from "@reach-mesh/sdk/gen/reach/v1/envelope_pb.js";

import { Mesh, within } from "./support/mesh.js";

/** `1` inside `depth` nested objects: the costliest nesting for protobuf decoders. */
function nestedObjects(depth: number): JsonValue {
  let value: JsonValue = 1;
  for (let level = 0; level < depth; level += 1) {
    value = { a: value };
  }
  return value;
}

/** `reason` of the ErrorInfo a grpc-js status carries. */
function reasonOf(status: grpc.StatusObject): string | undefined {
  return ReachError.from(Object.assign(new Error(status.details), status)).reason;
}

describe("bounds that keep shared streams alive", { timeout: 60_000 }, () => {
  let mesh: Mesh;
  let agent: RunningAgent;
  let client: MeshClient;
  let runs = 0;
  let started = () => {};
  let release = () => {};
  let holding = new Promise<void>((resolve) => (started = resolve));
  let gate = new Promise<void>((open) => (release = open));
  /** Resolved once the agent logged that a HandleMux frame could not be decoded. */
  let undecodable = () => {};
  const warnings: string[] = [];
  const logger: Logger = {
    info: () => {},
    warn: (message) => {
      warnings.push(message);
      if (message.includes("could not be decoded")) {
        undecodable();
      }
    },
  };

  /** Re-arms the hold handler for the next test. */
  const rearm = () => {
    holding = new Promise<void>((resolve) => (started = resolve));
    gate = new Promise<void>((open) => (release = open));
  };

  before(async () => {
    mesh = await Mesh.start();
    agent = await new AgentRuntime({
      service: "ts.bounds",
      instanceId: "ts-bounds-1",
      registry: mesh.endpoint,
      leaseTtlMs: 1000,
      logger,
    })
      .handle({ name: "ts.bounds.hold", version: "1.0.0" }, async () => {
        runs += 1;
        started();
        await gate;
        return makePayload("ts.held", dataPart({ held: true }));
      })
      .handle({ name: "ts.bounds.echo", version: "1.0.0" }, (_ctx, message) => {
        runs += 1;
        return message.payload ?? makePayload("ts.empty");
      })
      .handle({ name: "ts.bounds.deep", version: "1.0.0" }, () =>
        // dataPart refuses it inside the handler.
        makePayload("ts.deep", dataPart(nestedObjects(47))),
      )
      .handle({ name: "ts.bounds.bypass", version: "1.0.0" }, () =>
        // Built without dataPart: the runtime checks the reply itself.
        makePayload(
          "ts.deep",
          create(PartSchema, { content: { case: "data", value: valueOf(nestedObjects(47)) } }),
        ),
      )
      .handle({ name: "ts.bounds.nested", version: "1.0.0" }, async (ctx) => {
        const inner = new MeshClient({ source: "ts.bounds.inner", router: mesh.endpoint });
        try {
          // Nobody serves it: ROUTE_NOT_FOUND, which the handler lets escape.
          return (await inner.call("nobody.serves.this", makePayload("x"), callOptionsWithin(ctx)))
            .message.payload!;
        } finally {
          inner.close();
        }
      })
      .handleStream({ name: "ts.bounds.echo", version: "1.0.0" }, async function* () {
        yield makePayload("ts.one", textPart("one"));
        yield makePayload(
          "ts.deep",
          create(PartSchema, { content: { case: "data", value: valueOf(nestedObjects(47)) } }),
        );
      })
      .start();
    client = new MeshClient({ source: "ts.bounds-test", router: mesh.endpoint, multiplex: true });
    await mesh.waitForState("ts-bounds-1", InstanceState.READY);
  });

  after(async () => {
    release();
    client?.close();
    await agent?.drain();
    await mesh?.stop();
  });

  test("an undecodable HandleMux frame ends the stream INVALID_FRAME once the calls read are answered", async () => {
    rearm();
    runs = 0;
    const decodeLogged = new Promise<void>((resolve) => (undecodable = resolve));
    const raw = new grpc.Client(
      agent.endpoint.replace("http://", ""),
      grpc.credentials.createInsecure(),
    );
    const stream = raw.makeBidiStreamRequest<Buffer, Buffer>(
      "/reach.v1.AgentService/HandleMux",
      (bytes) => bytes,
      (bytes) => bytes,
    );
    const replies: bigint[] = [];
    stream.on("data", (bytes: Buffer) => {
      const frame = fromBinary(HandleMuxResponseSchema, bytes).frame;
      assert.equal(frame?.result.case, "reply", "call 1 got its reply");
      replies.push(frame.callId);
    });
    const ended = new Promise<grpc.StatusObject>((resolve) => stream.on("status", resolve));
    stream.on("error", () => {});
    try {
      const frame = (callId: bigint, capability: string) =>
        Buffer.from(
          toBinary(
            HandleMuxRequestSchema,
            create(HandleMuxRequestSchema, {
              frame: {
                callId,
                timeoutMs: 10_000,
                message: client.message({ capability }, makePayload("x", dataPart({}))),
              },
            }),
          ),
        );
      stream.write(frame(1n, "ts.bounds.hold"));
      await within(holding, 10_000, "call 1 to run");
      // Call 1 is running when the bad frame arrives; call 3 comes after it.
      stream.write(Buffer.from([0xff, 0xff, 0xff]));
      stream.write(frame(3n, "ts.bounds.echo"));
      await within(decodeLogged, 10_000, "the agent to see the undecodable frame");
      release();
      const status = await within(ended, 10_000, "the stream to end");
      assert.equal(status.code, Code.INVALID_ARGUMENT, status.details);
      assert.match(status.details, /could not be decoded/);
      assert.match(status.details, /calls without a reply were not handled/);
      assert.equal(reasonOf(status), Reason.INVALID_FRAME);
      assert.deepEqual(replies, [1n]);
      assert.equal(runs, 1, "no frame after the undecodable one was read");
    } finally {
      raw.close();
    }
  });

  test("a reply deeper than MAX_DATA_DEPTH fails its call INTERNAL and the shared streams go on", async () => {
    rearm();
    const held = client.call("ts.bounds.hold", makePayload("x"), { timeoutMs: 20_000 });
    await within(holding, 10_000, "the held call to run");
    // The router's HandleMux stream to the agent is open now.
    const agentStreams = agent.muxStreamsOpened;
    for (const capability of ["ts.bounds.deep", "ts.bounds.bypass"]) {
      const failed = await client.call(capability, makePayload("x"), { timeoutMs: 10_000 }).then(
        () => assert.fail(`${capability} should fail`),
        (e: unknown) => e,
      );
      assert.ok(failed instanceof ReachError, String(failed));
      assert.equal(failed.code, Code.INTERNAL, failed.message);
      assert.match(
        failed.statusMessage,
        new RegExp(`reply (part 0 )?nests 47 levels deep, over the limit of ${MAX_DATA_DEPTH}`),
      );
    }
    // Streams too: the deep reply ends the stream INTERNAL, after the reply before it.
    const stream = client.stream("ts.bounds.echo", { timeoutMs: 10_000 });
    await stream.send(makePayload("x", textPart("go")));
    stream.end();
    const texts: string[] = [];
    const streamed = await (async () => {
      for await (const reply of stream) {
        texts.push(reply.payload?.type ?? "");
      }
    })().then(
      () => assert.fail("the stream should fail"),
      (e: unknown) => e,
    );
    assert.deepEqual(texts, ["ts.one"]);
    assert.ok(streamed instanceof ReachError && streamed.code === Code.INTERNAL, String(streamed));

    release();
    const reply = await held;
    assert.deepEqual(reply.data, { held: true });
    assert.equal(client.muxStreamsOpened, 1, "the client's CallMux stream never broke");
    assert.equal(agent.muxStreamsOpened, agentStreams, "the router's HandleMux stream never broke");
  });

  test("data at MAX_DATA_DEPTH goes through CallMux and HandleMux; deeper data is not sent", async () => {
    const deepest = { data: nestedObjects(MAX_DATA_DEPTH - 1) };
    const echoed = await client.call("ts.bounds.echo", makePayload("x", dataPart(deepest)), {
      timeoutMs: 10_000,
    });
    assert.deepEqual(echoed.data, deepest);

    const refused = (() => {
      try {
        dataPart({ data: nestedObjects(MAX_DATA_DEPTH) });
      } catch (error) {
        return error;
      }
      return undefined;
    })();
    assert.ok(refused instanceof DataTooDeepError, String(refused));
    assert.ok(refused instanceof TypeError);
    assert.equal(refused.depth, MAX_DATA_DEPTH + 1);
    assert.equal(refused.limit, MAX_DATA_DEPTH);
    assert.equal(refused.path, `$.data${".a".repeat(MAX_DATA_DEPTH - 1)}`);

    runs = 0;
    const deep = makePayload(
      "x",
      create(PartSchema, {
        content: { case: "data", value: valueOf(nestedObjects(MAX_DATA_DEPTH + 3)) },
      }),
    );
    const invalid = await client.call("ts.bounds.echo", deep, { timeoutMs: 10_000 }).then(
      () => assert.fail("a deeper message should be refused"),
      (e: unknown) => e,
    );
    assert.ok(invalid instanceof ReachError, String(invalid));
    assert.equal(invalid.code, Code.INVALID_ARGUMENT);
    assert.equal(invalid.reason, Reason.INVALID_PAYLOAD);
    assert.deepEqual(invalid.metadata, {
      depth: String(MAX_DATA_DEPTH + 3),
      limit: String(MAX_DATA_DEPTH),
    });
    assert.equal(runs, 0, "nothing was sent");
    assert.equal(client.muxStreamsOpened, 1);
  });

  test("an oversized or unencodable call fails alone; concurrent calls on the stream go on", async () => {
    rearm();
    const held = client.call("ts.bounds.hold", makePayload("x"), { timeoutMs: 20_000 });
    await within(holding, 10_000, "the held call to run");
    // Over the router's transport limit for a frame: sent as a unary Call instead.
    const large = await client
      .call("ts.bounds.echo", makePayload("x", textPart("x".repeat(9 << 20))), {
        timeoutMs: 10_000,
      })
      .then(
        () => assert.fail("a 9 MiB call should fail"),
        (e: unknown) => e,
      );
    assert.ok(large instanceof ReachError && large.code === Code.RESOURCE_EXHAUSTED, String(large));
    // A field out of range cannot be encoded: grpc-js would cancel the whole stream.
    const unencodable = await client
      .call("ts.bounds.echo", makePayload("x"), { timeoutMs: 10_000, turn: -1 })
      .then(
        () => assert.fail("turn -1 cannot be encoded"),
        (e: unknown) => e,
      );
    assert.ok(unencodable instanceof ReachError, String(unencodable));
    assert.equal(unencodable.code, Code.INVALID_ARGUMENT);
    assert.equal(unencodable.reason, Reason.INVALID_PAYLOAD);
    release();
    assert.deepEqual((await held).data, { held: true });
    assert.equal(client.muxStreamsOpened, 1, "the shared stream never broke");
  });

  test("a nested call's delivery reason is not forwarded as the handler's own", async () => {
    const failed = await client
      .call("ts.bounds.nested", makePayload("x"), { timeoutMs: 10_000 })
      .then(
        () => assert.fail("the nested call fails"),
        (e: unknown) => e,
      );
    assert.ok(failed instanceof ReachError, String(failed));
    assert.equal(failed.code, Code.FAILED_PRECONDITION, failed.message);
    assert.equal(failed.reason, undefined);
    assert.match(failed.statusMessage, /^a call this handler made failed: /);
  });

  test("the unary Handle answers a too-deep reply INTERNAL", async () => {
    const direct = new RpcChannel(agent.endpoint, 1 << 20);
    try {
      const message = client.message({ capability: "ts.bounds.bypass" }, makePayload("x"));
      const failed = await direct
        .unary(AgentService.method.handle, { message }, { timeoutMs: 10_000 })
        .then(
          () => assert.fail("the reply is too deep"),
          (e: unknown) => e,
        );
      assert.ok(failed instanceof ReachError && failed.code === Code.INTERNAL, String(failed));
      assert.match(failed.statusMessage, /nests 47 levels deep/);
    } finally {
      direct.close();
    }
    assert.ok(warnings.includes("handler returned a reply that cannot be sent"), String(warnings));
  });
});
