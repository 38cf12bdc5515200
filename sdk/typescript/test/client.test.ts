/**
 * The Node MeshClient against `reach dev` with its Rust example agents: a unary call and a
 * stream answered by the coordinator's `complaint.classify`, the router's error for an
 * unknown capability, and a complaint-flow task started, read and resumed.
 */

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  Code,
  dataPart,
  isTraceId,
  jsonOf,
  makePayload,
  MeshClient,
  partData,
  Reason,
  ReachError,
  TaskStatus,
} from "@reach-mesh/sdk";

import { Mesh, waitFor } from "./support/mesh.js";

const CATEGORIES = ["servicing", "repayment", "credit_report", "origination"];

describe("MeshClient against reach dev's Rust agents", { timeout: 60_000 }, () => {
  let mesh: Mesh;
  let client: MeshClient;

  before(async () => {
    mesh = await Mesh.start({ agents: true });
    client = new MeshClient({ source: "ts.client-test", router: mesh.endpoint });
  });

  after(async () => {
    client?.close();
    await mesh?.stop();
  });

  test("a call to complaint.classify is answered by the Rust coordinator", async () => {
    const traceId = "4bf92f3577b34da6a3ce929d0e0e4736";
    const message = client.message(
      { capability: "complaint.classify" },
      makePayload(
        "complaint.submitted",
        dataPart({
          complaint_id: "1",
          narrative: "Equifax shows a derogatory tradeline on my credit report",
        }),
      ),
      { traceId },
    );
    const result = await client.send(message, { timeoutMs: 10_000 });
    assert.equal(result.data?.category, "credit_report");
    assert.equal(result.data?.capability, "complaint.credit_report");
    assert.equal(typeof result.data?.confidence, "number");
    assert.match(result.route?.instanceId ?? "", /^coordinator-/);
    assert.equal(result.route?.traceId, traceId, "the client's trace id is kept");
    assert.equal(result.message.header?.traceId, traceId);
    assert.equal(result.message.header?.correlationId, message.header?.messageId);
  });

  test("a call without a trace id starts a fresh trace at the edge", async () => {
    const result = await client.call(
      "complaint.classify",
      makePayload(
        "complaint.submitted",
        dataPart({ complaint_id: "2", narrative: "my autopay was misapplied" }),
      ),
      { timeoutMs: 10_000 },
    );
    assert.ok(isTraceId(result.route?.traceId ?? ""), result.route?.traceId);
    assert.ok(CATEGORIES.includes(String(result.data?.category)));
  });

  test("a stream to complaint.classify answers one classification per complaint, in order", async () => {
    const stream = client.stream("complaint.classify", { timeoutMs: 10_000 });
    await stream.send(
      makePayload(
        "complaint.submitted",
        dataPart({ complaint_id: "a", narrative: "late fee on my autopay" }),
      ),
    );
    await stream.send(
      makePayload(
        "complaint.submitted",
        dataPart({ complaint_id: "b", narrative: "my PSLF forgiveness was denied" }),
      ),
    );
    stream.end();
    const ids = [];
    for await (const reply of stream) {
      const data = partData(reply.payload!.parts[0]!) as { complaint_id: string; category: string };
      assert.ok(CATEGORIES.includes(data.category), data.category);
      assert.equal(reply.header?.traceId, stream.traceId);
      ids.push(data.complaint_id);
    }
    assert.deepEqual(ids, ["a", "b"]);
    assert.match((await stream.route)?.instanceId ?? "", /^coordinator-/);
  });

  test("an unknown capability is NOT_FOUND / ROUTE_NOT_FOUND with the router's summary", async () => {
    const error = await client
      .call("complaint.nonexistent", makePayload("x", dataPart({})), { timeoutMs: 5000 })
      .then(
        () => assert.fail("the call should fail"),
        (e: unknown) => e,
      );
    assert.ok(error instanceof ReachError, String(error));
    assert.equal(error.code, Code.NOT_FOUND);
    assert.equal(error.codeName, "NOT_FOUND");
    assert.equal(error.reason, Reason.ROUTE_NOT_FOUND);
    assert.equal(error.domain, "reach.dev");
    assert.equal(error.metadata.capability, "complaint.nonexistent");
    assert.match(error.metadata.routable_capabilities ?? "", /complaint\.classify/);
    assert.match(
      error.statusMessage,
      /no routable instance serves capability "complaint\.nonexistent"/,
    );
  });

  test("a complaint-flow task waits for a person, is resumed, and succeeds", async () => {
    const started = await client.startTask(
      "complaint-flow",
      { complaint_id: "3", narrative: "I have a question about my loan" },
      { taskId: `ts-test-${Date.now()}` },
    );
    assert.ok(isTraceId(started.traceId), "the task has a trace id");
    const waiting = await waitFor("the task to wait in human_review", async () => {
      const task = await client.getTask(started.taskId);
      return task.status === TaskStatus.WAITING_HUMAN ? task : undefined;
    });
    assert.equal(waiting.waiting?.nodeId, "human_review");
    const resumed = await client.resumeTask(started.taskId, {
      category: "servicing",
      note: "from the ts test",
    });
    assert.equal(resumed.taskId, started.taskId);
    const done = await waitFor("the task to succeed", async () => {
      const task = await client.getTask(started.taskId);
      return task.status === TaskStatus.SUCCEEDED ? task : undefined;
    });
    assert.equal((jsonOf(done.output) as { category?: string }).category, "servicing");
    const refused = await client
      .resumeTask(started.taskId, { category: "other" })
      .catch((e: unknown) => e);
    assert.ok(refused instanceof ReachError);
    assert.equal(refused.reason, Reason.TASK_NOT_WAITING);
  });
});
