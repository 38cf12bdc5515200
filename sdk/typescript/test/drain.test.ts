/**
 * Drain on SIGTERM, with the agent in a process of its own: the registry sees DRAINING, the
 * router sends it no new call, the call in flight finishes with its reply, the instance
 * deregisters (well before its lease could expire) and the process exits 0.
 */

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { once } from "node:events";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import {
  Code,
  dataPart,
  InstanceState,
  makePayload,
  MeshClient,
  Reason,
  ReachError,
} from "@reach-mesh/sdk";

import { Mesh, sdkDir, waitFor, within } from "./support/mesh.js";

describe("drain on SIGTERM", { timeout: 60_000 }, () => {
  let mesh: Mesh;
  let client: MeshClient;

  before(async () => {
    mesh = await Mesh.start();
    client = new MeshClient({ source: "ts.drain-test", router: mesh.endpoint });
  });

  after(async () => {
    client?.close();
    await mesh?.stop();
  });

  test("the call in flight finishes, the instance deregisters, the process exits 0", async () => {
    const agent = spawn(
      process.execPath,
      [join(sdkDir, "build/test/fixtures/held_agent.js"), mesh.endpoint, "ts-held-1"],
      {
        stdio: ["pipe", "pipe", "inherit"],
      },
    );
    const exited = once(agent, "exit");
    let stdout = "";
    agent.stdout.on("data", (chunk: Buffer) => (stdout += chunk.toString()));
    try {
      await mesh.waitForState("ts-held-1", InstanceState.READY);
      const inFlight = client.call("ts.held", makePayload("ts.go", dataPart({})), {
        timeoutMs: 20_000,
      });
      await waitFor("the handler to start", () => stdout.includes("started "));

      agent.kill("SIGTERM");
      await mesh.waitForState("ts-held-1", InstanceState.DRAINING);
      const refused = await client
        .call("ts.held", makePayload("ts.go", dataPart({})), { timeoutMs: 3000 })
        .catch((e: unknown) => e);
      assert.ok(refused instanceof ReachError, String(refused));
      assert.equal(refused.code, Code.NOT_FOUND, refused.message);
      assert.equal(refused.reason, Reason.ROUTE_NOT_FOUND, "a draining instance is not routed to");
      assert.equal(stdout.match(/started /g)?.length, 1, "no new call reached the handler");

      agent.stdin.write("release\n");
      const result = await inFlight;
      assert.deepEqual(result.data, { done: true }, "the call in flight finished with its reply");
      // The lease is 10 s: gone within 5 s means deregistered, not expired.
      await mesh.waitForGone("ts-held-1", 5000);
      const [code, signal] = await within(exited, 5000, "the agent to exit");
      assert.equal(signal, null);
      assert.equal(code, 0);
      assert.match(stdout, /stopped\n$/);
    } finally {
      if (agent.exitCode === null && agent.signalCode === null) {
        agent.kill("SIGKILL");
      }
    }
  });
});
