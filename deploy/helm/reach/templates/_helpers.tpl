{{/*
Names, labels and the pieces every Reach pod shares. Components: registry, router,
orchestrator, edge (when enabled), and one per agent ("agent-<name>").
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "reach.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prefix of every resource name: fullnameOverride, else "<release>-<chart>", or the release
name alone when it already contains the chart name. Kept to 40 characters so that the longest
suffix ("-orchestrator-store", "-agent-<name>") still fits a 63-character name.
*/}}
{{- define "reach.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "reach.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "reach-0.1.0", for the helm.sh/chart label. */}}
{{- define "reach.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Labels of every resource. Call with (dict "root" $ "component" "router").
*/}}
{{- define "reach.labels" -}}
helm.sh/chart: {{ include "reach.chart" .root }}
{{ include "reach.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: reach
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
The labels that select one component's pods (Deployments, Services, the PDB, the HPA's
target). Never add a label here that changes between upgrades: a Deployment's selector is
immutable. Call with (dict "root" $ "component" "router").
*/}}
{{- define "reach.selectorLabels" -}}
app.kubernetes.io/name: {{ include "reach.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* A component's resource name: (dict "root" $ "component" "router") -> "<fullname>-router". */}}
{{- define "reach.componentName" -}}
{{- printf "%s-%s" (include "reach.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The addresses the edge's agent cards advertise ([edge] public_url and public_grpc): edge.publicUrl
and edge.publicGrpc, else the edge Service's in-cluster DNS names (never the pod's own address).
*/}}
{{- define "reach.edge.publicUrl" -}}
{{- $host := printf "%s.%s.svc" (include "reach.componentName" (dict "root" . "component" "edge")) .Release.Namespace -}}
{{- .Values.edge.publicUrl | default (printf "%s://%s:%d" (include "reach.scheme" .) $host (int .Values.ports.a2a)) -}}
{{- end -}}
{{/*
The Host values the edge's HTTP port answers, as a JSON list ([edge] allowed_hosts): the edge
Service's DNS names, loopback, the host of edge.publicUrl and edge.allowedHosts.
*/}}
{{- define "reach.edge.allowedHosts" -}}
{{- $name := include "reach.componentName" (dict "root" . "component" "edge") -}}
{{- $ns := .Release.Namespace -}}
{{- $hosts := list $name (printf "%s.%s" $name $ns) (printf "%s.%s.svc" $name $ns) (printf "%s.%s.svc.cluster.local" $name $ns) "localhost" "127.0.0.1" "::1" -}}
{{- with .Values.edge.publicUrl }}{{ $hosts = append $hosts (urlParse .).hostname }}{{ end -}}
{{- range (.Values.edge.allowedHosts | default list) }}{{ $hosts = append $hosts . }}{{ end -}}
{{- $hosts | uniq | toJson -}}
{{- end -}}
{{- define "reach.edge.publicGrpc" -}}
{{- $host := printf "%s.%s.svc" (include "reach.componentName" (dict "root" . "component" "edge")) .Release.Namespace -}}
{{- .Values.edge.publicGrpc | default (printf "%s:%d" $host (int .Values.ports.grpc)) -}}
{{- end -}}

{{/* The gRPC URL of a component's Service, as other pods dial it: "http://<name>:7070" (https with TLS on). */}}
{{- define "reach.endpoint" -}}
{{- printf "%s://%s:%d" (include "reach.scheme" .root) (include "reach.componentName" .) (int .root.Values.ports.grpc) -}}
{{- end -}}

{{- define "reach.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "reach.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
An image reference from (dict "image" <an image block> "root" $): its repository, then
"@digest" when a digest is set, else ":tag" (the chart's appVersion when the tag is empty).
*/}}
{{- define "reach.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .root.Chart.AppVersion | toString) -}}
{{- end -}}
{{- end -}}

{{/* The pod's own identity, for node ids, advertised endpoints and resource attributes. */}}
{{- define "reach.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{/*
Logs and OpenTelemetry, the same for every service and agent (docs/observability.md). Comes
after reach.podEnv, whose variables OTEL_RESOURCE_ATTRIBUTES refers to.
*/}}
{{- define "reach.telemetryEnv" -}}
{{- with .Values.log.filter }}
- name: REACH_LOG
  value: {{ . | quote }}
{{- end }}
- name: REACH_LOG_FORMAT
  value: {{ .Values.log.format | quote }}
{{- with .Values.otel }}
{{- if .endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
{{- $attributes := list "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.pod.name=$(POD_NAME)" "service.instance.id=$(POD_NAME)" }}
{{- range $key, $value := .resourceAttributes }}
{{- $attributes = append $attributes (printf "%s=%s" $key (toString $value)) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attributes | quote }}
{{- with .sampler }}
- name: OTEL_TRACES_SAMPLER
  value: {{ . | quote }}
{{- end }}
{{- if ne (toString .samplerArg) "" }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | toString | quote }}
{{- end }}
{{- with .timeoutMillis }}
- name: OTEL_EXPORTER_OTLP_TIMEOUT
  value: {{ int64 . | toString | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The container ports of a service: gRPC and admin. */}}
{{- define "reach.servicePorts" -}}
- name: grpc
  containerPort: {{ .Values.ports.grpc | int }}
  protocol: TCP
- name: admin
  containerPort: {{ .Values.ports.admin | int }}
  protocol: TCP
{{- end -}}

{{/*
The gRPC probes of a service (grpc.health.v1 on its gRPC port): startup and liveness ask for
the server as a whole (service ""), readiness for the component's own gRPC service, which turns
NOT_SERVING as soon as shutdown begins. Call with (dict "root" $ "service" "reach.v1.RouterService").
*/}}
{{- define "reach.serviceProbes" -}}
{{- $port := .root.Values.ports.grpc | int -}}
{{- with .root.Values.probes -}}
startupProbe:
  grpc:
    port: {{ $port }}
  {{- toYaml .startup | nindent 2 }}
livenessProbe:
  grpc:
    port: {{ $port }}
  {{- toYaml .liveness | nindent 2 }}
readinessProbe:
  grpc:
    port: {{ $port }}
    service: {{ $.service }}
  {{- toYaml .readiness | nindent 2 }}
{{- end -}}
{{- end -}}

{{/*
The preStop hook and grace period of a component's pod spec: the hook keeps the pod serving
for preStopSleepSeconds while its Service endpoint is withdrawn, so no new connection reaches
a process that is already shutting down; the grace period is the whole budget (hook, drain,
trace flush) before SIGKILL. Call with (dict "component" .Values.router).
*/}}
{{- define "reach.terminationGracePeriod" -}}
terminationGracePeriodSeconds: {{ .component.terminationGracePeriodSeconds | int }}
{{- end -}}

{{- define "reach.lifecycle" -}}
{{- if gt (int .component.preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ .component.preStopSleepSeconds | int }}
{{- end }}
{{- end -}}

{{/* The scheduling fields a component may set. */}}
{{- define "reach.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{/* The pod-level fields every Reach pod shares. */}}
{{- define "reach.podCommon" -}}
serviceAccountName: {{ include "reach.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* Whether a protocol registry is deployed ("true" or ""). */}}
{{- define "reach.protocolRegistry.enabled" -}}
{{- if or .Values.protocolRegistry.content .Values.protocolRegistry.example -}}true{{- end -}}
{{- end -}}

{{/* The protocol registry's text: the given content, else the example fleet's. */}}
{{- define "reach.protocolRegistry.content" -}}
{{- if .Values.protocolRegistry.content -}}
{{- .Values.protocolRegistry.content -}}
{{- else if .Values.protocolRegistry.example -}}
{{- .Files.Get "files/protocol-registry.yaml" -}}
{{- end -}}
{{- end -}}

{{/* Where the protocol registry's ConfigMap is mounted, and the file in it. */}}
{{- define "reach.protocolRegistry.dir" -}}/etc/reach/protocol{{- end -}}
{{- define "reach.protocolRegistry.path" -}}/etc/reach/protocol/protocol-registry.yaml{{- end -}}

{{/* The flow files (name -> YAML): the example flows when enabled, then flows.files. */}}
{{- define "reach.flows" -}}
{{- $flows := dict -}}
{{- if .Values.flows.examples -}}
{{- range $path, $_ := .Files.Glob "files/flows/*.yaml" -}}
{{- $_ := set $flows (base $path) ($.Files.Get $path) -}}
{{- end -}}
{{- end -}}
{{- range $name, $text := .Values.flows.files -}}
{{- $_ := set $flows $name $text -}}
{{- end -}}
{{- toYaml $flows -}}
{{- end -}}

{{/* Where the orchestrator reads flows from (the flows ConfigMap). */}}
{{- define "reach.flows.dir" -}}/etc/reach/flows{{- end -}}

{{/* Where a component's TOML config file (its `config` value) is mounted. */}}
{{- define "reach.config.path" -}}/etc/reach/config/reach.toml{{- end -}}

{{/*
The volumes and mounts every Reach container needs with a read-only root filesystem: /tmp.
*/}}
{{- define "reach.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end -}}
{{- define "reach.tmpMount" -}}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/*
The TOML config volume of a component, when its `config` is set. Call with
(dict "root" $ "component" "router" "values" .Values.router).
*/}}
{{- define "reach.configVolume" -}}
{{- if .values.config }}
- name: config
  configMap:
    name: {{ include "reach.componentName" . }}-config
{{- end }}
{{- end -}}
{{- define "reach.configMount" -}}
{{- if .values.config }}
- name: config
  mountPath: {{ dir (include "reach.config.path" .root) }}
  readOnly: true
{{- end }}
{{- end -}}
{{- define "reach.configArgs" -}}
{{- if .values.config }}
- --config
- {{ include "reach.config.path" .root }}
{{- end }}
{{- end -}}

{{/*
The pod annotations of a component: checksums of what its pods read from ConfigMaps and
Secrets (so that a change rolls them), Prometheus scraping of the admin port for the services,
then the component's podAnnotations. Call with (dict "root" $ "values" .Values.router
"protocol" bool "flows" bool "store" bool "scrape" bool).
*/}}
{{- define "reach.podAnnotations" -}}
{{- $annotations := dict -}}
{{- if .values.config -}}
{{- $_ := set $annotations "checksum/config" (sha256sum .values.config) -}}
{{- end -}}
{{- /* No checksum of the policy: the services reload it in place (trust.policy.reloadInterval). */ -}}
{{- if and .protocol (include "reach.protocolRegistry.enabled" .root) -}}
{{- $_ := set $annotations "checksum/protocol-registry" (include "reach.protocolRegistry.content" .root | sha256sum) -}}
{{- end -}}
{{- if .flows -}}
{{- $_ := set $annotations "checksum/flows" (include "reach.flows" .root | sha256sum) -}}
{{- end -}}
{{- if .store -}}
{{- $_ := set $annotations "checksum/store" (.values.store.postgres.url | sha256sum) -}}
{{- end -}}
{{- if and .scrape .root.Values.metrics.scrapeAnnotations -}}
{{- $_ := set $annotations "prometheus.io/scrape" "true" -}}
{{- $_ := set $annotations "prometheus.io/port" (.root.Values.ports.admin | int | toString) -}}
{{- $_ := set $annotations "prometheus.io/path" "/metrics" -}}
{{- if .root.Values.trust.tls.enabled -}}
{{- $_ := set $annotations "prometheus.io/scheme" "https" -}}
{{- end -}}
{{- end -}}
{{- range $key, $value := .values.podAnnotations -}}
{{- $_ := set $annotations $key $value -}}
{{- end -}}
{{- with $annotations -}}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/*
Checks that values.schema.json cannot express; each failure says what to change.
*/}}
{{- define "reach.validate" -}}
{{- $o := .Values.orchestrator -}}
{{- if and $o.enabled (gt (int $o.replicas) 1) (eq $o.store.type "sqlite") -}}
{{- fail (printf "orchestrator.replicas is %d, but orchestrator.store.type is sqlite: a SQLite store belongs to one process. Run one replica, or set orchestrator.store.type=postgres and orchestrator.store.postgres.existingSecret (a Secret holding the postgres:// URL) to run several" (int $o.replicas)) -}}
{{- end -}}
{{- if and $o.enabled (eq $o.store.type "postgres") (not $o.store.postgres.existingSecret) (not $o.store.postgres.url) -}}
{{- fail "orchestrator.store.type is postgres, but neither orchestrator.store.postgres.existingSecret nor orchestrator.store.postgres.url is set: name the Secret (and its key, orchestrator.store.postgres.secretKey) holding the postgres://USER:PASSWORD@HOST:PORT/DB URL" -}}
{{- end -}}
{{- $r := .Values.registry -}}
{{- if and (gt (int $r.replicas) 1) (not $r.etcd.endpoints) -}}
{{- fail (printf "registry.replicas is %d, but registry.etcd.endpoints is empty: in-memory leases belong to one process. Run one replica, or set registry.etcd.endpoints (the etcd members' client URLs) to run several" (int $r.replicas)) -}}
{{- end -}}
{{- range $r.etcd.endpoints }}
{{- if and (hasPrefix "https://" .) (not $r.etcd.tlsSecret) -}}
{{- fail (printf "registry.etcd.endpoints has %q, but registry.etcd.tlsSecret is empty: https endpoints need TLS to etcd (a Secret with ca.crt, and tls.crt and tls.key with registry.etcd.tlsClientCert), or use http://" .) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.protocolRegistry.strict (not (include "reach.protocolRegistry.enabled" .)) -}}
{{- fail "protocolRegistry.strict needs a protocol registry to check registrations against: set protocolRegistry.content, or protocolRegistry.example=true" -}}
{{- end -}}
{{- $autoscaling := .Values.router.autoscaling -}}
{{- if and $autoscaling.enabled (gt (int $autoscaling.minReplicas) (int $autoscaling.maxReplicas)) -}}
{{- fail (printf "router.autoscaling.minReplicas (%d) is above router.autoscaling.maxReplicas (%d)" (int $autoscaling.minReplicas) (int $autoscaling.maxReplicas)) -}}
{{- end -}}
{{- $edge := .Values.edge -}}
{{- if and $edge.enabled $edge.autoscaling.enabled (gt (int $edge.autoscaling.minReplicas) (int $edge.autoscaling.maxReplicas)) -}}
{{- fail (printf "edge.autoscaling.minReplicas (%d) is above edge.autoscaling.maxReplicas (%d)" (int $edge.autoscaling.minReplicas) (int $edge.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- if and $edge.enabled .Values.trust.tls.enabled (eq .Values.trust.tls.clientAuth "required") -}}
{{- fail "edge.enabled with trust.tls.clientAuth=required: the A2A edge calls the mesh with its callers' bearer tokens on connections without a client certificate (so the policy judges the caller, never the edge), which a required client certificate refuses. Set trust.tls.clientAuth=optional (bearer tokens verified with trust.jwt)" -}}
{{- end -}}
{{- $components := list "registry" "router" "orchestrator" -}}
{{- if $edge.enabled -}}
{{- $components = append $components "edge" -}}
{{- end -}}
{{- range $name := $components -}}
{{- $component := index $.Values $name -}}
{{- if le (int $component.terminationGracePeriodSeconds) (int $component.preStopSleepSeconds) -}}
{{- fail (printf "%s.terminationGracePeriodSeconds (%d) must be above %s.preStopSleepSeconds (%d): the grace period includes the preStop sleep, and the drain after it" $name (int $component.terminationGracePeriodSeconds) $name (int $component.preStopSleepSeconds)) -}}
{{- end -}}
{{- end -}}
{{- $seen := dict -}}
{{- range $entry := .Values.agents -}}
{{- if hasKey $seen $entry.name -}}
{{- fail (printf "agents: the name %q is used twice; each agent is a Deployment named after it" $entry.name) -}}
{{- end -}}
{{- $_ := set $seen $entry.name true -}}
{{- /* As the Deployment sees it: agentDefaults, then the entry. */}}
{{- $agent := mergeOverwrite (deepCopy $.Values.agentDefaults) $entry -}}
{{- if le (int $agent.terminationGracePeriodSeconds) (int $agent.preStopSleepSeconds) -}}
{{- fail (printf "agents[%s].terminationGracePeriodSeconds (%d) must be above its preStopSleepSeconds (%d, agentDefaults included): the grace period includes the preStop sleep, and the drain after it" $entry.name (int $agent.terminationGracePeriodSeconds) (int $agent.preStopSleepSeconds)) -}}
{{- end -}}
{{- end -}}
{{- $trust := .Values.trust -}}
{{- if $trust.tls.certManager.enabled -}}
{{- if not $trust.tls.enabled -}}
{{- fail "trust.tls.certManager.enabled needs trust.tls.enabled=true: the Certificates are for the services to serve TLS with" -}}
{{- end -}}
{{- if not ($trust.tls.certManager.issuerRef | default dict).name -}}
{{- fail "trust.tls.certManager.enabled is true, but trust.tls.certManager.issuerRef.name is empty: name the cert-manager Issuer or ClusterIssuer (with kind) that signs the mesh certificates; it must be a CA issuer, the ca.crt peers verify against" -}}
{{- end -}}
{{- end -}}
{{- if and $trust.policy.existingConfigMap $trust.policy.rules -}}
{{- fail "trust.policy.rules and trust.policy.existingConfigMap are both set: give the policy inline (rules) or name the ConfigMap holding it, not both" -}}
{{- end -}}
{{- if eq (int .Values.ports.grpc) (int .Values.ports.admin) -}}
{{- fail (printf "ports.grpc and ports.admin are both %d: the gRPC and admin servers each need a port of their own" (int .Values.ports.grpc)) -}}
{{- end -}}
{{- if and $edge.enabled (has (int .Values.ports.a2a) (list (int .Values.ports.grpc) (int .Values.ports.admin))) -}}
{{- fail (printf "ports.a2a (%d) is also ports.grpc or ports.admin: the edge serves gRPC, admin and A2A JSON-RPC each on a port of its own" (int .Values.ports.a2a)) -}}
{{- end -}}
{{- end -}}

{{/*
A component's Service: its gRPC and admin ports (and, with "a2a" true, the edge's ports.a2a),
selecting its pods. Call with (dict "root" $ "component" "router" "service" .Values.router.service).
*/}}
{{- define "reach.service" -}}
{{- $ctx := dict "root" .root "component" .component -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "reach.componentName" $ctx }}
  labels:
    {{- include "reach.labels" $ctx | nindent 4 }}
  {{- with .service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ .service.type }}
  selector:
    {{- include "reach.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ .root.Values.ports.grpc | int }}
      targetPort: grpc
      protocol: TCP
      {{- if not .root.Values.trust.tls.enabled }}
      # gRPC without TLS: HTTP/2 over cleartext.
      appProtocol: kubernetes.io/h2c
      {{- end }}
    - name: admin
      port: {{ .root.Values.ports.admin | int }}
      targetPort: admin
      protocol: TCP
      appProtocol: {{ ternary "https" "http" .root.Values.trust.tls.enabled }}
    {{- if .a2a }}
    # The A2A JSON-RPC binding and the agent cards (HTTP/1.1, SSE for streams).
    - name: a2a
      port: {{ .root.Values.ports.a2a | int }}
      targetPort: a2a
      protocol: TCP
      appProtocol: {{ ternary "https" "http" .root.Values.trust.tls.enabled }}
    {{- end }}
{{- end -}}

{{/*
A component's TOML config file, when its `config` value is set. Call with
(dict "root" $ "component" "router" "values" .Values.router).
*/}}
{{- define "reach.configMap" -}}
{{- if .values.config -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "reach.componentName" . }}-config
  labels:
    {{- include "reach.labels" . | nindent 4 }}
data:
  {{ base (include "reach.config.path" .root) }}: |
    {{- .values.config | nindent 4 }}
{{- end -}}
{{- end -}}

{{/*
=== Trust (docs/security.md): TLS certificates, bearer-token keys and the policy. ===
*/}}

{{/* Where a pod's certificate Secret (tls.crt, tls.key, ca.crt), the token keys and the policy are mounted. */}}
{{- define "reach.tls.dir" -}}/etc/reach/tls{{- end -}}
{{- define "reach.jwt.dir" -}}/etc/reach/jwt{{- end -}}
{{- define "reach.policy.dir" -}}/etc/reach/policy{{- end -}}

{{/* Whether a policy is deployed ("true" or ""). */}}
{{- define "reach.policy.enabled" -}}
{{- with .Values.trust.policy -}}
{{- if or .existingConfigMap .rules -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* The ConfigMap holding the policy: the existing one, or the chart's. */}}
{{- define "reach.policy.configMap" -}}
{{- .Values.trust.policy.existingConfigMap | default (printf "%s-policy" (include "reach.fullname" .)) -}}
{{- end -}}

{{/*
The certificate Secret of a component: trust.tls.secrets.<component> (agents:
trust.tls.secrets.agents.<name>), else "<fullname>-<component>-tls" (what the chart's
cert-manager Certificates write). Call with (dict "root" $ "component" "router") or
(dict "root" $ "component" "agent-billing" "agent" "billing").
*/}}
{{- define "reach.tls.secretName" -}}
{{- $secrets := .root.Values.trust.tls.secrets -}}
{{- $named := "" -}}
{{- if .agent -}}
{{- $named = index ($secrets.agents | default dict) .agent | default "" -}}
{{- else -}}
{{- $named = index $secrets .component | default "" -}}
{{- end -}}
{{- $named | default (printf "%s-tls" (include "reach.componentName" .)) -}}
{{- end -}}

{{/* The scheme other pods dial a component's gRPC port with. */}}
{{- define "reach.scheme" -}}
{{- if .Values.trust.tls.enabled -}}https{{- else -}}http{{- end -}}
{{- end -}}

{{/*
The [trust] settings of a registry, router or orchestrator, as REACH_TRUST__* variables.
Without TLS the pods listen on 0.0.0.0 in plaintext, which a Reach service refuses unless
trust.insecure is set: the chart sets it, and NOTES.txt says the mesh is open.
*/}}
{{- define "reach.trustEnv" -}}
{{- with .Values.trust }}
- name: REACH_TRUST__TRUST_DOMAIN
  value: {{ .trustDomain | quote }}
{{- if .tls.enabled }}
- name: REACH_TRUST__TLS__CERT
  value: {{ include "reach.tls.dir" $ }}/tls.crt
- name: REACH_TRUST__TLS__KEY
  value: {{ include "reach.tls.dir" $ }}/tls.key
- name: REACH_TRUST__TLS__CA
  value: {{ include "reach.tls.dir" $ }}/ca.crt
- name: REACH_TRUST__TLS__CLIENT_AUTH
  value: {{ .tls.clientAuth | quote }}
- name: REACH_TRUST__TLS__RELOAD_INTERVAL
  value: {{ .tls.reloadInterval | quote }}
{{- else }}
# No TLS: anyone who can reach these ports owns the mesh (docs/security.md).
- name: REACH_TRUST__INSECURE
  value: "true"
{{- end }}
{{- if .jwt.secretName }}
{{- $keys := list }}
{{- range .jwt.keys }}
{{- $keys = append $keys (printf "%s/%s" (include "reach.jwt.dir" $) .) }}
{{- end }}
- name: REACH_TRUST__JWT__KEYS
  value: {{ $keys | toJson | quote }}
- name: REACH_TRUST__JWT__AUDIENCE
  value: {{ .jwt.audience | quote }}
{{- with .jwt.issuer }}
- name: REACH_TRUST__JWT__ISSUER
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- if include "reach.policy.enabled" $ }}
- name: REACH_TRUST__POLICY
  value: {{ include "reach.policy.dir" $ }}/{{ .policy.key }}
- name: REACH_TRUST__POLICY_RELOAD_INTERVAL
  value: {{ .policy.reloadInterval | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
The trust volumes and mounts of a service. Directories, never subPath: the kubelet updates a
mounted Secret or ConfigMap in place (an atomic symlink swap), which the services' reloaders
pick up, while a subPath mount never changes. Call with (dict "root" $ "component" "router").
*/}}
{{- define "reach.trustVolumes" -}}
{{- $v := .root.Values.trust -}}
{{- if $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "reach.tls.secretName" . }}
    defaultMode: 0440
{{- end }}
{{- if $v.jwt.secretName }}
- name: jwt-keys
  secret:
    secretName: {{ $v.jwt.secretName }}
    defaultMode: 0440
{{- end }}
{{- if include "reach.policy.enabled" .root }}
- name: policy
  configMap:
    name: {{ include "reach.policy.configMap" .root }}
{{- end }}
{{- end -}}
{{- define "reach.trustMounts" -}}
{{- $v := .root.Values.trust -}}
{{- if $v.tls.enabled }}
- name: tls
  mountPath: {{ include "reach.tls.dir" .root }}
  readOnly: true
{{- end }}
{{- if $v.jwt.secretName }}
- name: jwt-keys
  mountPath: {{ include "reach.jwt.dir" .root }}
  readOnly: true
{{- end }}
{{- if include "reach.policy.enabled" .root }}
- name: policy
  mountPath: {{ include "reach.policy.dir" .root }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
The probes of a service with TLS on: the kubelet's gRPC probes cannot speak TLS, so every
probe is an HTTPS GET of the admin port (open to clients without a certificate). Startup and
liveness GET /health, which answers whenever the process does; readiness GETs /ready, which
answers 503 while the service's grpc.health.v1 says NOT_SERVING (a registry whose etcd does
not answer, a router without its first registry snapshot, a process shutting down), as the
gRPC readiness probe without TLS would see.
*/}}
{{- define "reach.tlsProbes" -}}
{{- $port := .Values.ports.admin | int -}}
{{- with .Values.probes -}}
{{- range $kind, $probe := dict "startupProbe" (list "/health" .startup) "livenessProbe" (list "/health" .liveness) "readinessProbe" (list "/ready" .readiness) }}
{{ $kind }}:
  httpGet:
    path: {{ index $probe 0 }}
    port: {{ $port }}
    scheme: HTTPS
  {{- toYaml (index $probe 1) | nindent 2 }}
{{- end }}
{{- end -}}
{{- end -}}

{{/*
A cert-manager Certificate for one component, with its SPIFFE ID as the one URI SAN. Call with
(dict "root" $ "component" "router" "path" "router"); "name" names the Certificate (and its
Secret, "<name>-tls") instead of the component (a fleet agent's services).
*/}}
{{- define "reach.certificate" -}}
{{- $cm := .root.Values.trust.tls.certManager -}}
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: {{ .name | default (include "reach.componentName" .) }}
  labels:
    {{- include "reach.labels" . | nindent 4 }}
spec:
  secretName: {{ if .name }}{{ .name }}-tls{{ else }}{{ include "reach.tls.secretName" . }}{{ end }}
  duration: {{ $cm.duration }}
  renewBefore: {{ $cm.renewBefore }}
  # X.509-SVID style: the SPIFFE ID is the identity; peers do not check host names. The
  # Service name is added for clients that do (grpcurl, browsers).
  uris:
    - spiffe://{{ .root.Values.trust.trustDomain }}/{{ .path }}
  {{- if not (hasPrefix "agent/" .path) }}
  dnsNames:
    - {{ include "reach.componentName" . }}
    - {{ include "reach.componentName" . }}.{{ .root.Release.Namespace }}.svc
  {{- end }}
  privateKey:
    algorithm: ECDSA
    size: 256
    rotationPolicy: Always
  usages:
    - server auth
    - client auth
    - digital signature
  issuerRef:
    {{- toYaml $cm.issuerRef | nindent 4 }}
{{- end -}}

{{/*
The Host values a component's admin port answers on its operator routes and console, as a
JSON list ([admin] allowed_hosts): the component Service's DNS names, loopback and
admin.allowedHosts. Call with (dict "root" $ "component" "registry").
*/}}
{{- define "reach.admin.allowedHosts" -}}
{{- $name := include "reach.componentName" . -}}
{{- $ns := .root.Release.Namespace -}}
{{- $hosts := list $name (printf "%s.%s" $name $ns) (printf "%s.%s.svc" $name $ns) (printf "%s.%s.svc.cluster.local" $name $ns) "localhost" "127.0.0.1" "::1" -}}
{{- range (.root.Values.admin.allowedHosts | default list) }}{{ $hosts = append $hosts . }}{{ end -}}
{{- $hosts | uniq | toJson -}}
{{- end -}}
{{- define "reach.adminEnv" -}}
# The Host values the admin port's operator routes and console answer (DNS rebinding).
- name: REACH_ADMIN__ALLOWED_HOSTS
  value: {{ include "reach.admin.allowedHosts" . | quote }}
{{- end -}}

{{/*
=== The example fleet (`reach example-agents`): one process, several agent services. ===
*/}}

{{/* Whether an agent entry (as merged over agentDefaults) runs the example fleet ("true" or ""). */}}
{{- define "reach.agent.fleet" -}}
{{- if and .args (eq (toString (first .args)) "example-agents") -}}true{{- end -}}
{{- end -}}

{{/*
The services of the example fleet, each with its own identity (spiffe://<trustDomain>/agent/<service>):
what services/agents/src/fleet.rs starts (the chart tests compare the two).
*/}}
{{- define "reach.fleet.services" -}}
{{- list "coordinator" "ingest" "executor.servicing" "executor.repayment" "executor.credit_report" "executor.origination" | toJson -}}
{{- end -}}

{{/*
The Secret cert-manager writes for one fleet service of an agent: "<fullname>-agent-<name>-<service>-tls",
the service's dots and underscores as dashes. Call with (dict "root" $ "agent" "examples" "service" "executor.servicing").
*/}}
{{- define "reach.fleet.certificateName" -}}
{{- printf "%s-%s" (include "reach.componentName" (dict "root" .root "component" (printf "agent-%s" .agent))) (.service | replace "." "-" | replace "_" "-") -}}
{{- end -}}

{{/*
The tls volume of a fleet agent: with cert-manager, its services' Secrets projected into one
directory as `reach certs init` lays it out (agent-<service>.pem, agent-<service>-key.pem,
ca.pem); else the agent's Secret, which must hold those files. Call with (dict "root" $ "agent" $agent).
*/}}
{{- define "reach.fleet.tlsVolume" -}}
- name: tls
{{- if .root.Values.trust.tls.certManager.enabled }}
  projected:
    defaultMode: 0440
    sources:
      {{- range $i, $service := include "reach.fleet.services" .root | fromJsonArray }}
      - secret:
          name: {{ include "reach.fleet.certificateName" (dict "root" $.root "agent" $.agent.name "service" $service) }}-tls
          items:
            - key: tls.crt
              path: agent-{{ $service }}.pem
            - key: tls.key
              path: agent-{{ $service }}-key.pem
            {{- if eq $i 0 }}
            - key: ca.crt
              path: ca.pem
            {{- end }}
      {{- end }}
{{- else }}
  secret:
    secretName: {{ include "reach.tls.secretName" (dict "root" .root "component" (printf "agent-%s" .agent.name) "agent" .agent.name) }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/*
=== Network policies (networkPolicy, docs/deploy.md "Network policies"). ===
*/}}

{{/* The peers that are the mesh: this release's pods, then networkPolicy.meshPeers. */}}
{{- define "reach.networkPolicy.mesh" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "reach.name" . }}
      app.kubernetes.io/instance: {{ .Release.Name }}
{{- with .Values.networkPolicy.meshPeers }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
The NetworkPolicy of a control-plane component: its gRPC port from the mesh (or, with
"public" peers given, from those; an empty list: anyone), its admin port from the mesh and
networkPolicy.admin.from, and with "a2a" the edge's A2A port as its gRPC port. Call with
(dict "root" $ "component" "registry") or (dict "root" $ "component" "edge" "public" .Values.networkPolicy.edge.from "a2a" true).
*/}}
{{- define "reach.networkPolicy.component" -}}
{{- $ctx := dict "root" .root "component" .component -}}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "reach.componentName" $ctx }}
  labels:
    {{- include "reach.labels" $ctx | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "reach.selectorLabels" $ctx | nindent 6 }}
  policyTypes: [Ingress]
  ingress:
    {{- if hasKey . "public" }}
    # The mesh's public door: its callers authenticate at the edge itself.
    - ports:
        - port: grpc
          protocol: TCP
        {{- if .a2a }}
        - port: a2a
          protocol: TCP
        {{- end }}
      {{- with .public }}
      from:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- else }}
    - ports:
        - port: grpc
          protocol: TCP
      from:
        {{- include "reach.networkPolicy.mesh" .root | nindent 8 }}
    {{- end }}
    - ports:
        - port: admin
          protocol: TCP
      from:
        {{- include "reach.networkPolicy.mesh" .root | nindent 8 }}
        {{- with .root.Values.networkPolicy.admin.from }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}
