/**
 * Calls `complaint.classify` (the Rust coordinator of `reach dev`) through the router and
 * prints the classification.
 *
 *   reach dev &                       # registry, router, orchestrator and the example agents on :7070
 *   node build/examples/classify_complaint.js "my autopay was misapplied and I was charged a late fee"
 *   node build/examples/classify_complaint.js --router http://127.0.0.1:7070 "..."
 *
 * Prints `{"category": ..., "confidence": ..., "capability": ..., "instance": ..., "trace_id": ...}`;
 * on failure prints the error (code, reason, message) and exits 1.
 */

import { parseArgs } from "node:util";

import { dataPart, makePayload, MeshClient, ReachError } from "@reach-mesh/sdk";

const { values, positionals } = parseArgs({
  options: { router: { type: "string", default: "http://127.0.0.1:7070" } },
  allowPositionals: true,
});
const narrative = positionals.join(" ");
if (narrative === "") {
  process.stderr.write("usage: classify_complaint.js [--router URL] NARRATIVE\n");
  process.exit(64);
}

const client = new MeshClient({ source: "example.classify", router: values.router });
try {
  const result = await client.call(
    "complaint.classify",
    makePayload("complaint.submitted", dataPart({ complaint_id: "example-1", narrative })),
    { timeoutMs: 10_000 },
  );
  console.log(
    JSON.stringify({
      ...result.data,
      instance: result.route?.instanceId,
      trace_id: result.route?.traceId,
    }),
  );
} catch (error) {
  const failure = ReachError.from(error);
  console.error(`${failure.codeName} ${failure.reason ?? ""}: ${failure.statusMessage}`);
  process.exitCode = 1;
} finally {
  client.close();
}
