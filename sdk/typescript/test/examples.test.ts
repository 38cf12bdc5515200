/**
 * The examples as a user runs them, against `reach dev` with its Rust agents: the client
 * example classifies a complaint, and the agent example registers, answers through the
 * router and leaves the mesh on SIGTERM.
 */

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { once } from "node:events";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import { dataPart, InstanceState, makePayload, MeshClient } from "@reach-mesh/sdk";

import { Mesh, run, sdkDir, within } from "./support/mesh.js";

describe("the examples", { timeout: 60_000 }, () => {
  let mesh: Mesh;

  before(async () => {
    mesh = await Mesh.start({ agents: true });
  });

  after(async () => {
    await mesh?.stop();
  });

  test("classify_complaint prints the Rust coordinator's classification", async () => {
    const stdout = await run(process.execPath, [
      join(sdkDir, "build/examples/classify_complaint.js"),
      "--router",
      mesh.endpoint,
      "Equifax shows a derogatory tradeline on my credit report",
    ]);
    const printed = JSON.parse(stdout) as Record<string, unknown>;
    assert.equal(printed.category, "credit_report");
    assert.match(String(printed.instance), /^coordinator-/);
  });

  test("wordcount_agent serves text.wordcount and drains on SIGTERM", async () => {
    const agent = spawn(
      process.execPath,
      [
        join(sdkDir, "build/examples/wordcount_agent.js"),
        "--registry",
        mesh.endpoint,
        "--instance",
        "text-tools-1",
      ],
      { stdio: "ignore" },
    );
    const exited = once(agent, "exit");
    const client = new MeshClient({ source: "ts.examples-test", router: mesh.endpoint });
    try {
      await mesh.waitForState("text-tools-1", InstanceState.READY);
      const result = await client.call(
        "text.wordcount",
        makePayload("text", dataPart({ text: "the quick brown fox" })),
        {
          timeoutMs: 5000,
        },
      );
      assert.deepEqual(result.data, { words: 4, characters: 19 });
      agent.kill("SIGTERM");
      const [code] = await within(exited, 10_000, "the agent example to exit");
      assert.equal(code, 0);
      assert.equal(
        await mesh.instance("text-tools-1"),
        undefined,
        "it deregistered before exiting",
      );
    } finally {
      client.close();
      if (agent.exitCode === null && agent.signalCode === null) {
        agent.kill("SIGKILL");
      }
    }
  });
});
