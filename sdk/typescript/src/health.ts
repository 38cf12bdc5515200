/**
 * `grpc.health.v1.Health` for an agent's server: the registry's first probe asks for
 * `reach.v1.AgentService`, and Kubernetes-style probes ask for `""` (the server as a whole).
 *
 * @module
 */

import { create } from "@bufbuild/protobuf";
import * as grpc from "@grpc/grpc-js";

import { Code, ReachError } from "./errors.js";
import {
  type HealthCheckRequest,
  type HealthCheckResponse,
  HealthCheckResponse_ServingStatus as ServingStatus,
  HealthCheckResponseSchema,
} from "./gen/grpc/health/v1/health_pb.js";

export { ServingStatus };

/** The serving status of each service name, with `Check` and `Watch` over it. */
export class HealthReporter {
  readonly #statuses = new Map<string, ServingStatus>();
  readonly #watchers = new Set<(service: string) => void>();

  /** Sets `service`'s status ("" is the server's own) and tells every watcher of it. */
  set(service: string, status: ServingStatus): void {
    if (this.#statuses.get(service) === status) {
      return;
    }
    this.#statuses.set(service, status);
    for (const watcher of this.#watchers) {
      watcher(service);
    }
  }

  /** The grpc-js implementation of `grpc.health.v1.Health`. */
  implementation(): grpc.UntypedServiceImplementation {
    const check: grpc.handleUnaryCall<HealthCheckRequest, HealthCheckResponse> = (
      call,
      callback,
    ) => {
      const status = this.#statuses.get(call.request.service);
      if (status === undefined) {
        const error = new ReachError(
          Code.NOT_FOUND,
          `this server has no health status for service ${JSON.stringify(call.request.service)}; ask for "" or "reach.v1.AgentService"`,
        );
        callback(error.toGrpcStatus(), null);
        return;
      }
      callback(null, create(HealthCheckResponseSchema, { status }));
    };
    const watch: grpc.handleServerStreamingCall<HealthCheckRequest, HealthCheckResponse> = (
      call,
    ) => {
      const service = call.request.service;
      let last: ServingStatus | undefined;
      const send = () => {
        const status = this.#statuses.get(service) ?? ServingStatus.SERVICE_UNKNOWN;
        if (status !== last) {
          last = status;
          call.write(create(HealthCheckResponseSchema, { status }));
        }
      };
      const watcher = (changed: string) => {
        if (changed === service) {
          send();
        }
      };
      this.#watchers.add(watcher);
      call.once("cancelled", () => this.#watchers.delete(watcher));
      call.once("close", () => this.#watchers.delete(watcher));
      send();
    };
    return { check, watch };
  }
}
