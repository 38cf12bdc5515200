/**
 * Bounded concurrency, as the Rust SDK bounds it: an agent runs at most `maxConcurrency`
 * handlers at once and reports BUSY at its limit; the router sends it no more than that and
 * refuses a call that finds no room within `admission.max_wait` with UNAVAILABLE /
 * `OVERLOADED` and a retry hint; a message that reaches the agent beyond the limit waits for
 * a slot within its deadline and is not handled when the deadline passes first.
 */

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  AgentRuntime,
  type CallResult,
  Code,
  dataPart,
  InstanceState,
  makePayload,
  MeshClient,
  Reason,
  ReachError,
  RpcChannel,
  type RunningAgent,
  silentLogger,
} from "@reach-mesh/sdk";
import { AgentService } from "@reach-mesh/sdk/gen/reach/v1/agent_service_pb.js";

import { Mesh, waitFor } from "./support/mesh.js";

describe("bounded concurrency", { timeout: 60_000 }, () => {
  let mesh: Mesh;
  let agent: RunningAgent;
  let client: MeshClient;
  let running = 0;
  let most = 0;
  let handled = 0;
  let release: () => void = () => {};
  let gate = new Promise<void>((open) => (release = open));

  before(async () => {
    // The router sheds a call that waited 200 ms for room (default 5 s).
    mesh = await Mesh.start({ env: { REACH_ROUTER__ADMISSION__MAX_WAIT: "200ms" } });
    agent = await new AgentRuntime({
      service: "ts.holder",
      instanceId: "ts-holder-1",
      registry: mesh.endpoint,
      maxConcurrency: 2,
      leaseTtlMs: 300,
      logger: silentLogger,
    })
      .handle({ name: "ts.hold", version: "1.0.0" }, async () => {
        running += 1;
        handled += 1;
        most = Math.max(most, running);
        try {
          await gate;
        } finally {
          running -= 1;
        }
        return makePayload("ts.held", dataPart({ ok: true }));
      })
      .start();
    client = new MeshClient({ source: "ts.limits-test", router: mesh.endpoint });
    await mesh.waitForState("ts-holder-1", InstanceState.READY);
  });

  after(async () => {
    release();
    client?.close();
    await agent?.drain();
    await mesh?.stop();
  });

  test("beyond the limit the router refuses OVERLOADED and the agent waits", async () => {
    const hold = () =>
      client.call("ts.hold", makePayload("ts.hold", dataPart({})), { timeoutMs: 20_000 });
    const held: Array<Promise<CallResult>> = [hold(), hold()];
    await waitFor("two handlers to run", () => running === 2);
    await mesh.waitForState("ts-holder-1", InstanceState.BUSY);

    const refused = await hold().then(
      () => assert.fail("a third call should be refused"),
      (e: unknown) => e,
    );
    assert.ok(refused instanceof ReachError, String(refused));
    assert.equal(refused.code, Code.UNAVAILABLE);
    assert.equal(refused.reason, Reason.OVERLOADED);
    assert.equal(refused.retryAfterMs, 50, "the router's retry hint (admission.retry_after)");
    assert.equal(refused.metadata.retry_after_ms, "50");

    // Straight to the agent, past the router: the message waits for a slot within its deadline
    // and, when the deadline passes first, it was not handled.
    const direct = new RpcChannel(agent.endpoint, 1 << 20);
    const message = client.message({ capability: "ts.hold" }, makePayload("ts.hold", dataPart({})));
    const late = await direct
      .unary(AgentService.method.handle, { message }, { timeoutMs: 200 })
      .catch((e: unknown) => e);
    assert.ok(late instanceof ReachError, String(late));
    assert.equal(late.code, Code.DEADLINE_EXCEEDED);
    assert.equal(handled, 2, "the message that found no slot was not handled");
    direct.close();

    release();
    for (const result of await Promise.all(held)) {
      assert.deepEqual(result.data, { ok: true });
    }
    assert.equal(most, 2, "never more than maxConcurrency handlers at once");
    await mesh.waitForState("ts-holder-1", InstanceState.READY);
    gate = Promise.resolve();
    const after = await hold();
    assert.deepEqual(after.data, { ok: true });
  });
});
