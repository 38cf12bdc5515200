/**
 * A Node agent on a real `reach dev` (no example agents): it registers with its capability
 * descriptors, passes the registry's health probe (READY), answers calls and streams through
 * the router (over HandleMux and HandleStream), remembers redelivered message ids, maps its
 * errors onto the wire, and registers again when the registry lost its lease.
 */

import assert from "node:assert/strict";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import {
  ackPayload,
  AgentRuntime,
  Code,
  dataPart,
  firstData,
  InstanceState,
  makePayload,
  MeshClient,
  partText,
  Reason,
  ReachError,
  RpcChannel,
  type RunningAgent,
  silentLogger,
  textPart,
} from "@reach-mesh/sdk";
import {
  Health,
  HealthCheckResponse_ServingStatus,
} from "@reach-mesh/sdk/gen/grpc/health/v1/health_pb.js";
import { RegistryService } from "@reach-mesh/sdk/gen/reach/v1/registry_service_pb.js";

import { Mesh, repoRoot, run, sdkDir, waitFor } from "./support/mesh.js";

const SUM_INPUT = {
  type: "object",
  required: ["numbers"],
  properties: { numbers: { type: "array", items: { type: "number" } } },
};
const SUM_OUTPUT = { type: "object", required: ["sum"], properties: { sum: { type: "number" } } };

describe("a Node agent on reach dev", { timeout: 60_000 }, () => {
  let mesh: Mesh;
  let agent: RunningAgent;
  let client: MeshClient;
  /** The agent's own client, for its asynchronous replies. */
  let replier: MeshClient;
  /** How many times the sum handler ran, per message id. */
  const runs = new Map<string, number>();
  /** Messages the wait handler saw cancelled, by message id. */
  const told = new Set<string>();

  before(async () => {
    mesh = await Mesh.start();
    replier = new MeshClient({ source: "ts.math.ts-math-1", router: mesh.endpoint });
    agent = await new AgentRuntime({
      service: "ts.math",
      instanceId: "ts-math-1",
      registry: mesh.endpoint,
      leaseTtlMs: 300,
      topics: ["ts.events"],
      logger: silentLogger,
    })
      .handle(
        {
          name: "ts.sum",
          version: "1.2.0",
          description: "add a list of numbers; not for anything else",
          inputSchema: SUM_INPUT,
          outputSchema: SUM_OUTPUT,
        },
        (ctx, message) => {
          runs.set(ctx.messageId, (runs.get(ctx.messageId) ?? 0) + 1);
          const numbers = firstData(message.payload)?.numbers;
          if (!Array.isArray(numbers)) {
            throw ReachError.of(
              Code.INVALID_ARGUMENT,
              "numbers must be an array of numbers",
              "TS_BAD_NUMBERS",
              {
                field: "numbers",
              },
            );
          }
          ctx.setReplyMetadata("x-ts-handled-by", ctx.instanceId);
          const sum = numbers.reduce<number>((total, n) => total + Number(n), 0);
          return makePayload("ts.sum_result", dataPart({ sum }));
        },
      )
      .handle(
        { name: "ts.echo", version: "1.0.0" },
        (_ctx, message) => message.payload ?? makePayload("ts.empty"),
      )
      .handle({ name: "ts.later", version: "1.0.0" }, (ctx) => {
        // Acknowledge now, answer once the call has returned.
        setImmediate(
          () => void replier.reply(ctx, makePayload("ts.later", textPart("answered later"))),
        );
        return ackPayload();
      })
      .handle({ name: "ts.wait", version: "1.0.0" }, async (ctx) => {
        await new Promise((resolve) =>
          ctx.signal.addEventListener("abort", resolve, { once: true }),
        );
        told.add(ctx.messageId);
        throw new ReachError(Code.CANCELLED, "stopped as told");
      })
      .handleStream({ name: "ts.shout", version: "1.0.0" }, async function* (_ctx, first, rest) {
        yield makePayload(
          "ts.shouted",
          textPart((partText(first.payload!.parts[0]!) ?? "").toUpperCase()),
        );
        for await (const message of rest) {
          const text = partText(message.payload!.parts[0]!) ?? "";
          if (text === "stop") {
            throw ReachError.of(Code.FAILED_PRECONDITION, "told to stop", "TS_STOPPED");
          }
          yield makePayload("ts.shouted", textPart(text.toUpperCase()));
        }
      })
      .start();
    client = new MeshClient({ source: "ts.test", router: mesh.endpoint });
    await mesh.waitForState("ts-math-1", InstanceState.READY);
  });

  after(async () => {
    client?.close();
    replier?.close();
    await agent?.drain();
    await mesh?.stop();
  });

  test("registers its capabilities with versions, descriptions and schemas", async () => {
    const instance = await mesh.instance("ts-math-1");
    assert.equal(instance?.spec?.service, "ts.math");
    assert.equal(instance?.spec?.endpoint, agent.endpoint);
    assert.equal(instance?.spec?.maxConcurrency, 8, "the default concurrency limit is registered");
    assert.deepEqual(
      instance?.spec?.capabilities.map((c) => [c.name, c.version]),
      [
        ["ts.sum", "1.2.0"],
        ["ts.echo", "1.0.0"],
        ["ts.later", "1.0.0"],
        ["ts.wait", "1.0.0"],
        ["ts.shout", "1.0.0"],
      ],
    );
    const listed = await mesh.registry.unary(RegistryService.method.listCapabilities, {
      namePrefix: "ts.",
    });
    const sum = listed.capabilities.find((c) => c.name === "ts.sum");
    assert.equal(sum?.description, "add a list of numbers; not for anything else");
    assert.deepEqual(JSON.parse(sum?.inputSchema ?? "null"), SUM_INPUT);
    assert.deepEqual(JSON.parse(sum?.outputSchema ?? "null"), SUM_OUTPUT);
    assert.equal(sum?.routableInstances, 1);
  });

  test("serves grpc.health.v1: SERVING for the agent service and the server, NOT_FOUND otherwise", async () => {
    const direct = new RpcChannel(agent.endpoint, 1 << 20);
    try {
      for (const service of ["reach.v1.AgentService", ""]) {
        const health = await direct.unary(Health.method.check, { service }, { timeoutMs: 2000 });
        assert.equal(health.status, HealthCheckResponse_ServingStatus.SERVING, service);
      }
      const unknown = await direct
        .unary(Health.method.check, { service: "x.Nope" }, { timeoutMs: 2000 })
        .catch((e: unknown) => e);
      assert.ok(unknown instanceof ReachError);
      assert.equal(unknown.code, Code.NOT_FOUND);
    } finally {
      direct.close();
    }
  });

  test("answers a call through the router over HandleMux, on the caller's trace", async () => {
    const result = await client.call(
      "ts.sum",
      makePayload("ts.numbers", dataPart({ numbers: [1, 2, 3.5] })),
      {
        timeoutMs: 5000,
      },
    );
    assert.deepEqual(result.data, { sum: 6.5 });
    assert.equal(result.route?.instanceId, "ts-math-1");
    const header = result.message.header!;
    assert.equal(header.traceId, result.route?.traceId, "the reply is on the request's trace");
    assert.equal(header.correlationId, result.route?.messageId, "the reply answers the request");
    assert.equal(header.source, "ts.math.ts-math-1");
    assert.equal(header.turn, 1);
    assert.equal(header.metadata["x-ts-handled-by"], "ts-math-1");
    assert.ok(agent.muxStreamsOpened >= 1, "the router called over HandleMux");
  });

  test("runs a redelivered message id once and answers it with the first reply", async () => {
    const payload = makePayload("ts.numbers", dataPart({ numbers: [40, 2] }));
    const messageId = "01890000-0000-7000-8000-000000000042";
    const first = await client.call("ts.sum", payload, { messageId, timeoutMs: 5000 });
    const again = await client.call("ts.sum", payload, { messageId, timeoutMs: 5000 });
    assert.equal(runs.get(messageId), 1, "the handler ran once");
    assert.deepEqual(again.data, { sum: 42 });
    assert.equal(
      again.message.header?.messageId,
      first.message.header?.messageId,
      "the same reply",
    );
  });

  test("a handler's ReachError reaches the caller with its code, reason and metadata", async () => {
    const error = await client
      .call("ts.sum", makePayload("ts.numbers", dataPart({ numbers: "many" })), { timeoutMs: 5000 })
      .then(
        () => assert.fail("the call should fail"),
        (e: unknown) => e,
      );
    assert.ok(error instanceof ReachError);
    assert.equal(error.code, Code.INVALID_ARGUMENT);
    assert.equal(error.reason, "TS_BAD_NUMBERS");
    assert.equal(error.domain, "reach.dev");
    assert.deepEqual(error.metadata, { field: "numbers" });
    assert.equal(error.statusMessage, "numbers must be an array of numbers");
  });

  test("a capability the instance does not handle is UNIMPLEMENTED / CAPABILITY_NOT_HANDLED", async () => {
    const error = await client
      .callService("ts.math", makePayload("ts.unknown", textPart("?")), { timeoutMs: 5000 })
      .catch((e: unknown) => e);
    assert.ok(error instanceof ReachError, String(error));
    assert.equal(error.code, Code.UNIMPLEMENTED);
    assert.equal(error.reason, Reason.CAPABILITY_NOT_HANDLED);
    assert.match(error.statusMessage, /it handles: ts\.echo, ts\.later, ts\.sum, ts\.wait/);
  });

  test("a caller's deadline reaches the handler: its signal aborts", async () => {
    const payload = makePayload("ts.wait", dataPart({}));
    const message = client.message({ capability: "ts.wait" }, payload);
    const error = await client.send(message, { timeoutMs: 300 }).catch((e: unknown) => e);
    assert.ok(error instanceof ReachError, String(error));
    assert.equal(error.code, Code.DEADLINE_EXCEEDED);
    await waitFor("the handler to be told", () => told.has(message.header!.messageId));
  });

  test("answers asynchronously: an acknowledgement now, the answer through Reply later", async () => {
    const result = await client.call("ts.later", makePayload("ts.later", dataPart({})), {
      asyncReply: true,
      timeoutMs: 5000,
    });
    assert.equal(partText(result.message.payload!.parts[0]!), "answered later");
    assert.equal(result.message.header?.correlationId, result.route?.messageId);
  });

  test("takes messages published to its topic", async () => {
    const published = await client.publish("ts.events", makePayload("ts.echo", textPart("event")), {
      timeoutMs: 5000,
    });
    assert.equal(published.delivered, 1);
    assert.equal(published.failed, 0);
  });

  test("serves a bidirectional stream through the router, reply by reply", async () => {
    const stream = client.stream("ts.shout", { timeoutMs: 5000 });
    await stream.send(makePayload("ts.text", textPart("hello")));
    await stream.send(makePayload("ts.text", textPart("mesh")));
    stream.end();
    const replies: string[] = [];
    for await (const reply of stream) {
      assert.equal(reply.header?.traceId, stream.traceId);
      replies.push(partText(reply.payload!.parts[0]!) ?? "");
    }
    assert.deepEqual(replies, ["HELLO", "MESH"]);
    assert.equal((await stream.route)?.instanceId, "ts-math-1");
  });

  test("a stream handler's error reaches the caller after the replies it yielded", async () => {
    const stream = client.stream("ts.shout", { timeoutMs: 5000 });
    await stream.send(makePayload("ts.text", textPart("one")));
    await stream.send(makePayload("ts.text", textPart("stop")));
    stream.end();
    const replies: string[] = [];
    const failure = await (async () => {
      for await (const reply of stream) {
        replies.push(partText(reply.payload!.parts[0]!) ?? "");
      }
    })().catch((e: unknown) => e);
    assert.deepEqual(replies, ["ONE"]);
    assert.ok(failure instanceof ReachError, String(failure));
    assert.equal(failure.code, Code.FAILED_PRECONDITION);
    assert.equal(failure.reason, "TS_STOPPED");
  });

  test("with multiplex, calls go as frames on one CallMux stream: replies, errors and cancels", async () => {
    const mux = new MeshClient({ source: "ts.test-mux", router: mesh.endpoint, multiplex: true });
    try {
      const [a, b] = await Promise.all([
        mux.call("ts.sum", makePayload("ts.numbers", dataPart({ numbers: [1, 1] })), {
          timeoutMs: 5000,
        }),
        mux.call("ts.sum", makePayload("ts.numbers", dataPart({ numbers: [2, 2] })), {
          timeoutMs: 5000,
        }),
      ]);
      assert.deepEqual([a.data, b.data], [{ sum: 2 }, { sum: 4 }]);
      assert.equal(a.route?.instanceId, "ts-math-1");
      assert.equal(a.message.header?.correlationId, a.route?.messageId);

      const unknown = await mux
        .call("ts.nope", makePayload("x"), { timeoutMs: 5000 })
        .catch((e: unknown) => e);
      assert.ok(unknown instanceof ReachError, String(unknown));
      assert.equal(unknown.code, Code.NOT_FOUND);
      assert.equal(
        unknown.reason,
        Reason.ROUTE_NOT_FOUND,
        "the CallError's details carry the ErrorInfo",
      );

      const message = mux.message({ capability: "ts.wait" }, makePayload("ts.wait"));
      const late = await mux.send(message, { timeoutMs: 200 }).catch((e: unknown) => e);
      assert.ok(late instanceof ReachError, String(late));
      assert.equal(late.code, Code.DEADLINE_EXCEEDED);
      await waitFor("the handler to be told", () => told.has(message.header!.messageId));

      const after = await mux.call(
        "ts.sum",
        makePayload("ts.numbers", dataPart({ numbers: [3] })),
        { timeoutMs: 5000 },
      );
      assert.deepEqual(after.data, { sum: 3 });
      assert.equal(mux.muxStreamsOpened, 1, "every call went over the one stream");
    } finally {
      mux.close();
    }
  });

  test("with multiplex, a peer without CallMux gets unary Calls", async () => {
    // The agent's own port serves no RouterService at all: CallMux is UNIMPLEMENTED, so the
    // call goes unary, and that is UNIMPLEMENTED too — for /Call.
    const mux = new MeshClient({ source: "ts.test-mux", router: agent.endpoint, multiplex: true });
    try {
      for (let i = 0; i < 2; i++) {
        const error = await mux
          .call("ts.sum", makePayload("x"), { timeoutMs: 5000 })
          .catch((e: unknown) => e);
        assert.ok(error instanceof ReachError, String(error));
        assert.equal(error.code, Code.UNIMPLEMENTED);
        assert.match(error.statusMessage, /RouterService\/Call\b/);
      }
      assert.equal(mux.muxStreamsOpened, 1, "the link remembers that CallMux is not served");
    } finally {
      mux.close();
    }
  });

  test("answers a Python client (the reach_mesh SDK) through the router", async (t) => {
    const python = process.env.REACH_PYTHON ?? join(repoRoot, ".venv/bin/python");
    if (!existsSync(python)) {
      t.skip(`no Python at ${python}: run scripts/python-env.sh or set REACH_PYTHON`);
      return;
    }
    const endpoint = mesh.endpoint.replace("http://", "");
    const stdout = await run(python, [
      join(sdkDir, "test/fixtures/python_call.py"),
      endpoint,
      "ts.sum",
      '{"numbers": [1, 2, 39]}',
    ]);
    const reply = JSON.parse(stdout) as {
      instance_id: string;
      trace_id: string;
      reply_trace_id: string;
      source: string;
      data: unknown;
    };
    assert.equal(reply.instance_id, "ts-math-1");
    assert.deepEqual(reply.data, { sum: 42 });
    assert.match(reply.trace_id, /^[0-9a-f]{32}$/);
    assert.equal(reply.reply_trace_id, reply.trace_id, "the caller's trace id reaches the reply");
    assert.equal(reply.source, "ts.math.ts-math-1");
  });

  test("a handler's unexpected exception answers INTERNAL with an error id, its text only in the log", async () => {
    const logged: Array<Record<string, unknown>> = [];
    const running = await new AgentRuntime({
      service: "ts.faulty",
      instanceId: "ts-faulty-1",
      registry: mesh.endpoint,
      logger: {
        info: () => {},
        warn: (message, fields) => logged.push({ message, ...fields }),
      },
    })
      .handle({ name: "ts.faulty.run", version: "1.0.0" }, () => {
        throw new RangeError("boom: password hunter2");
      })
      .start();
    try {
      await mesh.waitForState("ts-faulty-1", InstanceState.READY);
      await assert.rejects(
        client.call("ts.faulty.run", makePayload("t"), { timeoutMs: 5000 }),
        (error: unknown) => {
          assert.ok(error instanceof ReachError);
          assert.equal(error.code, Code.INTERNAL);
          const match = /^handler failed; error id ([0-9a-f-]{36}); see the agent's log$/.exec(
            error.statusMessage,
          );
          assert.ok(match, error.statusMessage);
          assert.ok(!error.statusMessage.includes("hunter2"));
          // The agent's log has the detail under the same id.
          const entry = logged.find((fields) => fields.error_id === match[1]);
          assert.ok(entry, JSON.stringify(logged));
          assert.equal(entry.error, "RangeError: boom: password hunter2");
          return true;
        },
      );
    } finally {
      await running.drain();
    }
  });

  test("a registration the registry refuses as invalid is not retried: run() drains and throws", async () => {
    const runtime = new AgentRuntime({
      service: "ts.bad",
      registry: mesh.endpoint,
      logger: silentLogger,
    }).handle(
      // "type" must be a string or a list: the registry cannot compile this schema.
      { name: "ts.bad.echo", version: "1.0.0", inputSchema: { type: 12 } },
      (_ctx, message) => message.payload ?? makePayload("t"),
    );
    await assert.rejects(runtime.run(), (error: Error) => {
      assert.match(error.message, /the registry refused this agent's registration: .*input_schema/);
      assert.ok(error.cause instanceof ReachError);
      assert.equal(error.cause.code, Code.INVALID_ARGUMENT);
      return true;
    });
  });

  test("registers again when the registry no longer knows its lease", async () => {
    // A restarted registry is empty: the agent's next heartbeat is NOT_FOUND / LEASE_NOT_FOUND.
    await mesh.restart();
    const back = await mesh.waitForState("ts-math-1", InstanceState.READY);
    assert.deepEqual(
      back.spec?.capabilities.map((c) => c.name),
      ["ts.sum", "ts.echo", "ts.later", "ts.wait", "ts.shout"],
    );
    const result = await client.call(
      "ts.sum",
      makePayload("ts.numbers", dataPart({ numbers: [1] })),
      { timeoutMs: 5000 },
    );
    assert.deepEqual(result.data, { sum: 1 });
  });
});
