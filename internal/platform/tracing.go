package platform

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"golang.org/x/net/http/httpguts"
)

// OTLPEndpointVariable is the standard variable that turns on the export of spans: the base URL
// of an OTLP/HTTP receiver (http://jaeger:4318). The exporter reads it, and the other
// OTEL_EXPORTER_OTLP_* variables, itself.
const OTLPEndpointVariable = "OTEL_EXPORTER_OTLP_ENDPOINT"

// traceFlushTimeout bounds the export of the last spans at shutdown: the process must exit
// within 10 s of the signal (see HardStop), and a receiver that is gone must not hold it.
const traceFlushTimeout = 2 * time.Second

// readOTLPEndpoint reads OTEL_EXPORTER_OTLP_ENDPOINT, which is optional: "" exports nothing.
// The name is spelled out in the call, as for every variable, for deploy/compose_test.go to
// find what the services read. It takes no user or password, but one left there with a / ? or
// # unescaped would reach the path, which the exporter's errors quote: that is refused first,
// as for DATABASE_URL (see AtAfterHost), without the value.
func readOTLPEndpoint(env *Env) string {
	// The traces-only endpoint does not turn the export on, and where it is set the exporter
	// sends there, past these checks: refused, so that neither happens without a word.
	env.Check(env.String("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "") == "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
		"is not read: set OTEL_EXPORTER_OTLP_ENDPOINT, the receiver's base URL")
	v := env.String("OTEL_EXPORTER_OTLP_ENDPOINT", "")
	if v == "" {
		return ""
	}
	checkOTLPOptions(env)
	if AtAfterHost(v) {
		env.fail(OTLPEndpointVariable, "%s", AtAfterHostProblem)
		return ""
	}
	u, err := url.Parse(v)
	env.Check(err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != "", OTLPEndpointVariable, "must be an http or https URL")
	if err == nil {
		checkInsecure(env, u.Scheme)
	}
	env.Check(err != nil || PortsInRange(u), OTLPEndpointVariable, badURLPort)
	// The exporter sends to the URL's host and path only: a user, a password or a query
	// would be dropped without a word, and every export refused.
	env.Check(err != nil || u.User == nil, OTLPEndpointVariable,
		"must not hold a user or password, which the exporter does not send: give them as a header in OTEL_EXPORTER_OTLP_HEADERS (Authorization=Basic%20...)")
	env.Check(err != nil || (u.RawQuery == "" && !u.ForceQuery), OTLPEndpointVariable,
		"must not have a query, which the exporter does not send: give a token as a header in OTEL_EXPORTER_OTLP_HEADERS")
	// The exporter adds /v1/traces to the path: one there already would have every span sent
	// to /v1/traces/v1/traces, and refused.
	env.Check(err != nil || !strings.HasSuffix(path.Clean("/"+u.Path), "/v1/traces"), OTLPEndpointVariable,
		"is the receiver's base URL, to which the exporter adds /v1/traces itself: drop /v1/traces")
	return v
}

// checkOTLPOptions checks the exporter's own variables that it ignores when they are bad,
// starting without them, with at most a line on stderr in a format of its own: a timeout not
// in whole milliseconds, as the specification has it (5s is not one), a compression other than
// gzip or none (it takes any other, GZIP too, for none without a word), a protocol other than
// OTLP/HTTP's two (grpc too: see below), a TLS file it cannot read or parse, a client
// certificate without its key (not a word either), a header entry its parser drops; and the
// batch span processor's, which it reads with the exporter (see checkBatchOptions). The
// exporter and the processor read them (deploy's libraryVars); this only checks them.
func checkOTLPOptions(env *Env) {
	for _, name := range []string{"OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"} {
		if v := env.String(name, ""); v != "" {
			checkHeaders(env, name, v)
		}
	}
	checkBatchOptions(env)
	for _, name := range []string{"OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"} {
		if v := env.String(name, ""); v != "" {
			// 0 would export with no timeout at all; an hour is more than any export should wait
			// (and a value past 9.2e12 would overflow the exporter's time.Duration).
			ms, err := strconv.Atoi(v)
			env.Check(err == nil && ms >= 1 && ms <= 3_600_000, name, "must be a whole number of milliseconds, 1 to 3600000 (10000 for 10 s)")
		}
	}
	for _, name := range []string{"OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"} {
		if v := env.String(name, ""); v != "" {
			env.Check(v == "gzip" || v == "none", name, "must be gzip or none")
		}
	}
	// The exporter speaks OTLP/HTTP alone, and sends any other value, grpc or HTTP/JSON as much
	// as a typo, as http/protobuf: to a gRPC receiver's port every export fails, in lines that
	// name no variable.
	if name, v := otlpInEffect(env, "PROTOCOL"); name != "" {
		env.Check(v == "http/protobuf" || v == "http/json", name,
			"must be http/protobuf or http/json: spans are exported over OTLP/HTTP only (a receiver's port 4318, not gRPC's 4317)")
	}
	for _, name := range []string{"OTEL_EXPORTER_OTLP_CERTIFICATE", "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"} {
		if v := env.String(name, ""); v != "" {
			pem, err := os.ReadFile(v)
			if err != nil {
				env.fail(name, "%v", err)
			} else {
				env.Check(x509.NewCertPool().AppendCertsFromPEM(pem), name, "must be a file of PEM certificates")
			}
		}
	}
	for _, pair := range [][2]string{
		{"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_KEY"},
		{"OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY"},
	} {
		checkClientCertificate(env, pair[0], pair[1])
	}
}

// checkInsecure checks OTEL_EXPORTER_OTLP_INSECURE and its _TRACES_ form, which the exporter
// reads after the endpoint, overriding its scheme: true (in any case) posts in plain HTTP, any
// other value is false and speaks TLS. So true with an https endpoint sends the spans, and
// OTEL_EXPORTER_OTLP_HEADERS' credentials, in cleartext; false (or yes, or 1) with an http one
// fails every export. Only the one in effect is checked (see otlpInEffect); the endpoint's
// scheme alone says the same without them.
func checkInsecure(env *Env, scheme string) {
	name, v := otlpInEffect(env, "INSECURE")
	switch {
	case name == "":
	case !strings.EqualFold(v, "true") && !strings.EqualFold(v, "false"):
		env.fail(name, "must be true or false: the exporter takes any other value for false")
	case strings.EqualFold(v, "true") && scheme == "https":
		env.fail(name, "is true, with which the exporter posts to the https endpoint in plain HTTP, OTEL_EXPORTER_OTLP_HEADERS' credentials in cleartext: unset it, the endpoint's scheme says it")
	case strings.EqualFold(v, "false") && scheme == "http":
		env.fail(name, "is false, with which the exporter speaks TLS to the http endpoint, failing every export: unset it, the endpoint's scheme says it")
	}
}

// otlpInEffect is the variable of the exporter's setting key (PROTOCOL, INSECURE) that it
// takes, and its value: the _TRACES_ form over the other, as it reads them; "" if neither is
// set. The one it overrides is never read, so never refused.
func otlpInEffect(env *Env, key string) (name, value string) {
	for _, n := range []string{"OTEL_EXPORTER_OTLP_TRACES_" + key, "OTEL_EXPORTER_OTLP_" + key} {
		if v := env.String(n, ""); v != "" {
			return n, v
		}
	}
	return "", ""
}

// checkHeaders checks the headers list v of the variable name by the exporter's parser's rules,
// which drops each entry that breaks them, with at most a line on stderr in a format of its
// own, and exports without it (an Authorization left out: every export refused): key=value
// entries separated by commas, each key (spaces around it trimmed) a header name, each value
// percent-decodable. A value must also be one HTTP can carry once decoded (no control
// character), or every export fails. No error quotes an entry, nor even a key that fails: an
// entry without its "=" may be all secret ("Authorization: Bearer ...").
func checkHeaders(env *Env, name, v string) {
	entries := strings.Split(v, ",")
	for i, entry := range entries {
		at := fmt.Sprintf("entry %d of %d", i+1, len(entries))
		key, value, found := strings.Cut(entry, "=")
		key = strings.TrimSpace(key)
		if !found {
			env.fail(name, "%s is not key=value: give each header as key=value, the value percent-encoded (Authorization=Bearer%%20...), separated by commas", at)
			continue
		}
		if !httpguts.ValidHeaderFieldName(key) {
			env.fail(name, "%s: its key is not a header name (letters, digits and !#$%%&'*+-.^_`|~)", at)
			continue
		}
		decoded, err := url.PathUnescape(value)
		if err != nil {
			env.fail(name, "%s (%s): its value is not percent-encoded: write a %% as %%25", at, key)
			continue
		}
		env.Check(httpguts.ValidHeaderFieldValue(strings.TrimSpace(decoded)), name,
			fmt.Sprintf("%s (%s): its value holds a character a header cannot carry", at, key))
	}
}

// maxBatchQueue bounds OTEL_BSP_MAX_QUEUE_SIZE: the processor allocates its queue whole at start.
const maxBatchQueue = 1_000_000

// checkBatchOptions checks the batch span processor's variables, which the SDK reads with
// strconv.Atoi, untrimmed, taking anything else for its default without a word: 10s for
// OTEL_BSP_SCHEDULE_DELAY is its 5000 ms. A delay of 0 or less makes it spin, exporting empty
// batches in a loop; a queue or batch size below 0 makes the start panic; a queue of 0 drops
// each span that finds the processor busy, a batch of 0 exports each span alone; a batch larger
// than the queue (2048 unless set) it lowers to at most 512. An export timeout of 0 is the
// processor's own "none": the exporter's _TIMEOUT still bounds each attempt. An hour bounds
// both durations, as it does _TIMEOUT (past 9.2e12 ms the SDK's time.Duration overflows).
func checkBatchOptions(env *Env) {
	queue, queueTaken := batchInt(env, "OTEL_BSP_MAX_QUEUE_SIZE", sdktrace.DefaultMaxQueueSize, 1, maxBatchQueue, "spans")
	// 0: unset (the SDK's 512, lowered to the queue's size without harm), or refused already.
	batch, _ := batchInt(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 0, 1, maxBatchQueue, "spans")
	if queueTaken && batch > queue {
		env.fail("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "must be at most OTEL_BSP_MAX_QUEUE_SIZE (%d unless set)", sdktrace.DefaultMaxQueueSize)
	}
	batchInt(env, "OTEL_BSP_SCHEDULE_DELAY", 0, 1, 3_600_000, "milliseconds")
	batchInt(env, "OTEL_BSP_EXPORT_TIMEOUT", 0, 0, 3_600_000, "milliseconds")
}

// batchInt reads the variable name as the batch span processor does, a whole number with no
// spaces around it, which must be from lo to hi: def when unset, and when refused, with taken
// false.
func batchInt(env *Env, name string, def, lo, hi int, unit string) (n int, taken bool) {
	if env.String(name, "") == "" {
		return def, true
	}
	raw, _ := env.lookup(name)
	n, err := strconv.Atoi(raw)
	if err != nil || n < lo || n > hi {
		env.fail(name, "must be a whole number of %s from %d to %d, without spaces", unit, lo, hi)
		return def, false
	}
	return n, true
}

// checkClientCertificate checks that the variables certName and keyName are set together, to
// files that hold a certificate and its private key.
func checkClientCertificate(env *Env, certName, keyName string) {
	certFile, keyFile := env.String(certName, ""), env.String(keyName, "")
	if certFile == "" && keyFile == "" {
		return
	}
	if certFile == "" || keyFile == "" {
		env.fail(certName+", "+keyName, "must be set together")
		return
	}
	cert, certErr := os.ReadFile(certFile)
	if certErr != nil {
		env.fail(certName, "%v", certErr)
	}
	key, keyErr := os.ReadFile(keyFile)
	if keyErr != nil {
		env.fail(keyName, "%v", keyErr)
	}
	if certErr != nil || keyErr != nil {
		return
	}
	// Its error names no secret: a key's bytes are never quoted.
	if _, err := tls.X509KeyPair(cert, key); err != nil {
		env.fail(certName+", "+keyName, "%v", err)
	}
}

// checkResourceAttributes checks OTEL_RESOURCE_ATTRIBUTES, which the tracer provider's
// resource reads itself: a pair without its "=" (a trailing comma, say) fails the resource,
// and with it the start, with an error that names no variable; a value whose percent-escapes
// url.PathUnescape refuses, as the resource decodes them (50%zz, a bare %), it keeps as
// written, saying so only in a line on stderr.
func checkResourceAttributes(env *Env) {
	v := env.String("OTEL_RESOURCE_ATTRIBUTES", "")
	if v == "" {
		return
	}
	for pair := range strings.SplitSeq(v, ",") {
		key, value, found := strings.Cut(pair, "=")
		if !found || strings.TrimSpace(key) == "" {
			env.fail("OTEL_RESOURCE_ATTRIBUTES", "must be key=value pairs separated by commas; %q is not one", pair)
			return
		}
		if _, err := url.PathUnescape(strings.TrimSpace(value)); err != nil {
			env.fail("OTEL_RESOURCE_ATTRIBUTES", "the value of %q must be percent-encoded (%%25 for a %%, %%2C for a comma)", strings.TrimSpace(key))
			return
		}
	}
}

// startTracing installs the process's tracer provider as the global one, which the HTTP
// middleware and pkg/messaging use. It exists whether spans are exported or not: it gives every
// request and every message without an incoming trace a new one, whose trace id its log lines
// carry. Only with export does it send spans anywhere, by OTLP over HTTP to the endpoint the
// exporter reads from the environment; otherwise a span ends where it started. Every trace
// is sampled unless an incoming trace context says it was not.
func startTracing(ctx context.Context, log *slog.Logger, service string, export bool) (*sdktrace.TracerProvider, error) {
	res, err := resource.New(ctx, resource.WithFromEnv(), resource.WithTelemetrySDK(),
		resource.WithAttributes(semconv.ServiceName(service)))
	if err != nil {
		return nil, fmt.Errorf("tracing: resource: %w", err)
	}
	opts := []sdktrace.TracerProviderOption{
		sdktrace.WithResource(res),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.AlwaysSample())),
	}
	if export {
		exporter, err := otlptracehttp.New(ctx)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", OTLPEndpointVariable, err)
		}
		opts = append(opts, sdktrace.WithBatcher(exporter))
	}
	tp := sdktrace.NewTracerProvider(opts...)
	otel.SetTracerProvider(tp)
	// W3C Trace Context, the contract's traceparent, and W3C Baggage: the messaging library
	// reads and writes trace contexts with the global propagator. The HTTP middleware reads a
	// public client's without its baggage (see edgeTraceContext).
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	// The SDK reports a failed export here, once per batch, instead of on stderr in a format
	// of its own.
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) { log.Warn("tracing failed", "error", err) }))
	return tp, nil
}

// stopTracing exports the spans still waiting, within traceFlushTimeout.
func stopTracing(log *slog.Logger, tp *sdktrace.TracerProvider) {
	ctx, cancel := context.WithTimeout(context.Background(), traceFlushTimeout)
	defer cancel()
	if err := tp.Shutdown(ctx); err != nil {
		log.Warn("spans not exported at shutdown", "error", err)
	}
}
