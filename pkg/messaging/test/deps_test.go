package test

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// What the demo and the library's tests need, and a service importing the library must not be
// made to download: ORMs and drivers, Kubernetes, compose, fault injection, SMTP, HTTP routing,
// the OpenTelemetry SDK and its exporters, gRPC, goose, zerolog.
var demoDependencies = []string{
	"gorm.io", "github.com/jackc/pgx", "k8s.io", "compose-spec", "toxiproxy", "emersion/go-smtp", "go-chi",
	"go.opentelemetry.io/otel/sdk", "go.opentelemetry.io/otel/exporters", "google.golang.org/grpc", "pressly/goose", "rs/zerolog",
}

const libraryModule = "github.com/outboxkit/outbox-inbox/pkg/messaging"

// A new module that imports only the library gets the library's own dependencies, none of the
// demo's or its tests'; and the library asks for no newer Go than 1.25.
func TestAFreshModuleGetsOnlyTheLibrarysDependencies(t *testing.T) {
	t.Parallel()
	lib := libraryDir(t)
	if v := goDirective(t, filepath.Join(lib, "go.mod")); v != "1.25" && !strings.HasPrefix(v, "1.25.") {
		t.Errorf("the library's go.mod says go %s, want 1.25.x", v)
	}
	mods := freshModule(t, map[string]string{libraryModule: lib}, `package main

import "github.com/outboxkit/outbox-inbox/pkg/messaging"

func main() {
	messaging.NewPublisher(messaging.PublisherConfig{URL: "amqp://localhost"}).Close()
}
`)
	wantNone(t, mods, demoDependencies)
}

// A module that imports the pgx adapter gets pgx and what pgx needs besides the library's own
// dependencies, and nothing of the demo's.
func TestAFreshModuleOfThePgxDriverGetsOnlyPgx(t *testing.T) {
	t.Parallel()
	lib := libraryDir(t)
	mods := freshModule(t, map[string]string{libraryModule: lib, libraryModule + "/pgxdriver": filepath.Join(lib, "pgxdriver")}, `package main

import (
	"context"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/pgxdriver"
)

func main() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := messaging.MigrateOutbox(ctx, pgxdriver.New(pool).DB()); err != nil {
		panic(err)
	}
}
`)
	if !slices.Contains(mods, "github.com/jackc/pgx/v5") {
		t.Errorf("no pgx among the modules of a pgx driver's user")
	}
	var others []string
	for _, d := range demoDependencies {
		if d != "github.com/jackc/pgx" {
			others = append(others, d)
		}
	}
	wantNone(t, mods, others)
}

// libraryDir is the absolute path of the library's module, this one's parent.
func libraryDir(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if got := modulePath(t, filepath.Join(dir, "go.mod")); got != libraryModule {
		t.Fatalf("%s is module %s, want the library", dir, got)
	}
	return dir
}

// goMod is what go mod edit -json says of a go.mod file.
type goMod struct {
	Module  struct{ Path string }
	Go      string
	Require []struct{ Path string }
}

func readGoMod(t *testing.T, path string) goMod {
	t.Helper()
	out, err := exec.Command("go", "mod", "edit", "-json", path).Output()
	if err != nil {
		t.Fatalf("go mod edit -json %s: %v", path, err)
	}
	var m goMod
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatalf("go mod edit -json %s: %v", path, err)
	}
	return m
}

func modulePath(t *testing.T, gomod string) string { return readGoMod(t, gomod).Module.Path }

func goDirective(t *testing.T, gomod string) string {
	t.Helper()
	v := readGoMod(t, gomod).Go
	if v == "" {
		t.Fatalf("%s has no go directive", gomod)
	}
	return v
}

// freshModule makes module example.com/fresh in a directory of its own, with main.go and the
// given modules replaced by their local directories, outside this repository's workspace; it
// tidies and builds it, and returns its modules (go list -m all), logged with their count.
func freshModule(t *testing.T, replace map[string]string, mainGo string) []string {
	t.Helper()
	dir := t.TempDir()
	gomod := "module example.com/fresh\n\ngo 1.25\n\nrequire (\n"
	for mod := range replace {
		gomod += "\t" + mod + " v0.0.0\n"
	}
	gomod += ")\n\n"
	for mod, path := range replace {
		gomod += "replace " + mod + " => " + path + "\n"
	}
	for name, content := range map[string]string{"go.mod": gomod, "main.go": mainGo} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	goCmd := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("go", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	goCmd("mod", "tidy")
	goCmd("build", "-o", os.DevNull, ".")
	mods := strings.Fields(goCmd("list", "-m", "-f", "{{.Path}}", "all"))
	if len(mods) == 0 || mods[0] != "example.com/fresh" {
		t.Fatalf("go list -m all: %q, want the fresh module first", mods)
	}
	deps := mods[1:]
	required := readGoMod(t, filepath.Join(dir, "go.mod")).Require
	t.Logf("%d modules in the fresh module's graph (go list -m all), %d of them in its go.mod after go mod tidy:\n%s",
		len(deps), len(required), strings.Join(deps, "\n"))
	return deps
}

// wantNone fails t for each module whose path contains one of forbidden.
func wantNone(t *testing.T, mods, forbidden []string) {
	t.Helper()
	for _, m := range mods {
		for _, f := range forbidden {
			if strings.Contains(m, f) {
				t.Errorf("module %s (%s) is among the dependencies", m, f)
			}
		}
	}
}
