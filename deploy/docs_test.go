package deploy_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/constant"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode"
)

// readmeMaxLines keeps the README an entry point a newcomer reads to the end; the detail
// belongs in docs/.
const readmeMaxLines = 350

// TestDocs holds the README and docs/ together: every relative link leads to a file that
// exists and, with a #fragment, to a heading (or an explicit anchor) of that file; every file
// of docs/ is linked from the README; and the README stays short.
func TestDocs(t *testing.T) {
	t.Parallel()
	files := docFiles(t)
	readme := filepath.Join(root, "README.md")
	for _, file := range files {
		for _, l := range markdownLinks(t, file) {
			if err := checkLink(file, l.target); err != nil {
				t.Errorf("%s:%d: link %q: %v", rel(file), l.line, l.target, err)
			}
		}
	}

	raw, err := os.ReadFile(readme)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(raw), "\n"); n > readmeMaxLines {
		t.Errorf("README.md has %d lines, more than %d: move the detail into docs/", n, readmeMaxLines)
	}
	var linked []string
	for _, l := range markdownLinks(t, readme) {
		path, _, _ := strings.Cut(l.target, "#")
		linked = append(linked, filepath.Clean(filepath.Join(root, path)))
	}
	for _, file := range files {
		if file != readme && !slices.Contains(linked, filepath.Clean(file)) {
			t.Errorf("%s is not linked from README.md", rel(file))
		}
	}
}

// The checker must find what it is for: a broken file, a broken anchor, an anchor GitHub
// numbers for a repeated heading, and links inside code left alone.
func TestDocsLinkChecker(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	write("b.md", "# Title\n\n## `pkg/messaging` in a minute\n\n### Run\n\n### Run\n\n<a id=\"kept\"></a>\n```\n## Not a heading\n```\n")
	a := write("a.md", strings.Join([]string{
		"[ok](b.md) [ok](b.md#pkgmessaging-in-a-minute) [ok](b.md#run-1) [ok](b.md#kept) [ok](#self)",
		"[missing file](c.md) [missing anchor](b.md#nope) [code heading](b.md#not-a-heading)",
		"`[in code](c.md)` [web](https://example.com/x.md#y)",
		"```", "[in a block](c.md)", "```",
		"## Self",
	}, "\n"))
	var broken []string
	for _, l := range markdownLinks(t, a) {
		if checkLink(a, l.target) != nil {
			broken = append(broken, l.target)
		}
	}
	want := []string{"c.md", "b.md#nope", "b.md#not-a-heading"}
	if !slices.Equal(broken, want) {
		t.Errorf("broken links found: %q, want %q", broken, want)
	}
}

// docFiles lists README.md, every Markdown file of docs/ and the library's README.
func docFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("docs/ holds no Markdown file")
	}
	files = append(files, filepath.Join(root, "pkg", "messaging", "README.md"))
	return append([]string{filepath.Join(root, "README.md")}, files...)
}

func rel(file string) string {
	r, err := filepath.Rel(root, file)
	if err != nil {
		return file
	}
	return r
}

type mdLink struct {
	target string
	line   int
}

var (
	linkPattern       = regexp.MustCompile(`\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	inlineCodePattern = regexp.MustCompile("`+[^`]*`+")
	headingPattern    = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*#*\s*$`)
	htmlAnchorPattern = regexp.MustCompile(`<a\s+(?:id|name)="([^"]+)"`)
	schemePattern     = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)
)

// markdownLines returns the lines of file outside fenced code blocks, with their numbers.
func markdownLines(file string) ([]mdLine, error) {
	raw, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var lines []mdLine
	fence := ""
	for i, line := range strings.Split(string(raw), "\n") {
		trimmed := strings.TrimSpace(line)
		if fence == "" && (strings.HasPrefix(trimmed, "```") || strings.HasPrefix(trimmed, "~~~")) {
			fence = trimmed[:3]
			continue
		}
		if fence != "" {
			if strings.HasPrefix(trimmed, fence) {
				fence = ""
			}
			continue
		}
		lines = append(lines, mdLine{text: line, n: i + 1})
	}
	return lines, nil
}

type mdLine struct {
	text string
	n    int
}

// markdownLinks returns the inline links of file, outside code.
func markdownLinks(t *testing.T, file string) []mdLink {
	t.Helper()
	lines, err := markdownLines(file)
	if err != nil {
		t.Fatal(err)
	}
	var links []mdLink
	for _, l := range lines {
		for _, m := range linkPattern.FindAllStringSubmatch(inlineCodePattern.ReplaceAllString(l.text, ""), -1) {
			links = append(links, mdLink{target: m[1], line: l.n})
		}
	}
	return links
}

// anchors returns the fragments a Markdown file has: its headings' slugs as GitHub makes
// them (repeated ones numbered -1, -2 …) and its explicit HTML anchors.
func anchors(file string) (map[string]bool, error) {
	lines, err := markdownLines(file)
	if err != nil {
		return nil, err
	}
	found, seen := map[string]bool{}, map[string]int{}
	for _, l := range lines {
		for _, m := range htmlAnchorPattern.FindAllStringSubmatch(l.text, -1) {
			found[m[1]] = true
		}
		m := headingPattern.FindStringSubmatch(l.text)
		if m == nil {
			continue
		}
		slug := headingSlug(m[1])
		if n := seen[slug]; n > 0 {
			found[fmt.Sprintf("%s-%d", slug, n)] = true
		} else {
			found[slug] = true
		}
		seen[slug]++
	}
	return found, nil
}

var linkTextPattern = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`)

// headingSlug is GitHub's anchor for a heading: its text (a link's, for a link), lowercased,
// without punctuation, spaces turned into hyphens.
func headingSlug(heading string) string {
	heading = linkTextPattern.ReplaceAllString(heading, "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case unicode.IsLetter(r) || unicode.IsDigit(r) || r == '-' || r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteRune('-')
		}
	}
	return b.String()
}

// checkLink checks one link of file: nothing for a URL with a scheme; for a relative one, that
// its file exists and that its fragment, if any, is an anchor of that Markdown file.
func checkLink(file, target string) error {
	if schemePattern.MatchString(target) {
		return nil
	}
	path, fragment, _ := strings.Cut(target, "#")
	dest := file
	if path != "" {
		dest = filepath.Join(filepath.Dir(file), filepath.FromSlash(path))
	}
	if _, err := os.Stat(dest); err != nil {
		return fmt.Errorf("no such file: %s", rel(dest))
	}
	if fragment == "" {
		return nil
	}
	if !strings.HasSuffix(dest, ".md") {
		return fmt.Errorf("a fragment into %s, which is not Markdown", rel(dest))
	}
	found, err := anchors(dest)
	if err != nil {
		return err
	}
	if !found[fragment] {
		return fmt.Errorf("%s has no heading or anchor %q", rel(dest), fragment)
	}
	return nil
}

// configRowPattern is a row of docs/configuration.md's variables table: | `NAME` | services |.
var configRowPattern = regexp.MustCompile("^\\|\\s*`([A-Z][A-Z0-9_]*)`\\s*\\|\\s*([^|]+?)\\s*\\|")

// Every variable docs/configuration.md's table documents is one the services it names read
// (readVars) or one their libraries read (libraryVars): a documented variable given in
// docker-compose.yml or deploy/k8s/config.yaml must pass TestComposeApps and
// TestK8sServiceConfiguration; so is every OTEL_* variable the docs name. And every variable a
// service reads is in the table.
func TestDocsConfigurationVariables(t *testing.T) {
	t.Parallel()
	lines, err := markdownLines(filepath.Join(root, "docs", "configuration.md"))
	if err != nil {
		t.Fatal(err)
	}
	read := map[string][]string{}
	for _, a := range apps {
		read[a.name] = readVars(t, a.name)
	}
	documented := map[string][]string{} // service -> variables the table gives it
	for _, l := range lines {
		m := configRowPattern.FindStringSubmatch(l.text)
		if m == nil {
			continue
		}
		name, who := m[1], strings.Split(m[2], ",")
		if strings.TrimSpace(m[2]) == "all" {
			who = nil
			for _, a := range apps {
				who = append(who, a.name)
			}
		}
		for _, svc := range who {
			svc = strings.TrimSpace(svc)
			known, ok := read[svc]
			if !ok {
				t.Errorf("docs/configuration.md:%d: %s is documented for %q, which is no service", l.n, name, svc)
				continue
			}
			documented[svc] = append(documented[svc], name)
			if !slices.Contains(known, name) && !slices.Contains(libraryVars, name) {
				t.Errorf("docs/configuration.md:%d: %s is documented for %s, which neither reads it (readVars found %v) nor has it in libraryVars", l.n, name, svc, known)
			}
		}
	}
	if len(documented) == 0 {
		t.Fatal("docs/configuration.md: no row | `NAME` | services | found in the variables table")
	}
	// Any OpenTelemetry variable the docs name (OTEL_EXPORTER_OTLP_HEADERS, say) may be set
	// too, unless named as one that has no effect; a wildcard (OTEL_EXPORTER_OTLP_*) names none.
	otel := regexp.MustCompile(`\bOTEL_[A-Z0-9_]*\*?`)
	for _, file := range docFiles(t) {
		lines, err := markdownLines(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range lines {
			for _, name := range otel.FindAllString(l.text, -1) {
				if strings.HasSuffix(name, "*") || strings.HasSuffix(name, "_") || slices.Contains(ignoredOTELVars, name) {
					continue
				}
				if !slices.Contains(read[apps[0].name], name) && !slices.Contains(libraryVars, name) {
					t.Errorf("%s:%d: names %s, which no service reads nor libraryVars allows", rel(file), l.n, name)
				}
			}
		}
	}

	// readVars reads all of internal/platform for each service (order "reads" CONSUMER_*), so
	// this direction is checked for the services together.
	var all []string
	for _, names := range documented {
		all = append(all, names...)
	}
	for svc, names := range read {
		for _, name := range names {
			if !slices.Contains(all, name) {
				t.Errorf("services/%s reads %s, which docs/configuration.md's table does not document", svc, name)
			}
		}
	}
}

// markdownSection returns the lines of file under the heading whose text is title, up to the
// next heading of the same level or higher, outside code blocks.
func markdownSection(t *testing.T, file, title string) string {
	t.Helper()
	lines, err := markdownLines(file)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	level := 0
	for _, l := range lines {
		hashes := len(l.text) - len(strings.TrimLeft(l.text, "#"))
		if m := headingPattern.FindStringSubmatch(l.text); m != nil {
			if level > 0 && hashes <= level {
				break
			}
			if m[1] == title {
				level = hashes
				continue
			}
		}
		if level > 0 {
			b.WriteString(l.text + "\n")
		}
	}
	if level == 0 {
		t.Fatalf("%s has no heading %q", rel(file), title)
	}
	return b.String()
}

// An order pod held in its init container (kubectl get pods: Init:0/1, Init:Error,
// Init:CrashLoopBackOff) is what an operator sees when the topology was never declared: the
// runbook of the alerts that fire then names that container, as order.yaml does, and how to list
// the topology resources with the field it waits for.
func TestDocsRunbookTopologyWait(t *testing.T) {
	t.Parallel()
	d, ok := k8s(t).deployments[topologyWaiter]
	if !ok || len(d.Spec.Template.Spec.InitContainers) != 1 {
		t.Fatalf("want Deployment %s with one init container, the wait for the topology", topologyWaiter)
	}
	container := d.Spec.Template.Spec.InitContainers[0].Name
	ops := filepath.Join(root, "docs", "operations.md")
	for _, alert := range []string{"ServiceDown", "ServiceNotRunning"} {
		section := markdownSection(t, ops, alert)
		for _, want := range []string{"Init:0/1", container} {
			if !strings.Contains(section, want) {
				t.Errorf("docs/operations.md, runbook %s: does not name %s (an order pod waiting for the topology)", alert, want)
			}
		}
	}
	section := markdownSection(t, ops, "ServiceDown")
	for _, want := range []string{
		"kubectl logs <pod> -c " + container,
		"kubectl get " + strings.Join(topologyResources, ","),
		"OBSERVED:" + strings.Trim(strings.TrimPrefix(declaredOnce, "jsonpath="), "{}"),
	} {
		if !strings.Contains(section, want) {
			t.Errorf("docs/operations.md, runbook ServiceDown: does not give `%s`", want)
		}
	}
}

// configDefaultCell is the default column of a row of docs/configuration.md's variables table.
var configDefaultCell = regexp.MustCompile("^\\|\\s*`([A-Z][A-Z0-9_]*)`\\s*\\|([^|]*)\\|[^|]*\\|\\s*([^|]*?)\\s*\\|\\s*$")

var (
	// plainDefault is a default cell that is one literal, perhaps with a note after it:
	// `168h` (7 days).
	plainDefault = regexp.MustCompile("^`([^`]+)`(?:\\s+\\([^)]*\\))?$")
	// perServiceDefault is one literal per service: order `:8080`, invoicing `:8081`.
	perServiceDefault = regexp.MustCompile("^[a-z]+ `[^`]+`(?:, [a-z]+ `[^`]+`)*$")
	serviceDefault    = regexp.MustCompile("([a-z]+) `([^`]+)`")
)

// Every default docs/configuration.md's table gives as a plain literal (`500`, `5m`, order
// `:8080`) is the one the code falls back on, read off the code itself: the default argument of
// each Env accessor call (Int, Duration, String, …) in internal/platform and each service's
// package, as the Go type checker evaluates it (a constant of another package, 5*time.Minute),
// and, for HTTP_ADDR, the address each service gives ReadCommon. A default the code computes
// (2 × batch size) has no literal cell, and "required" is checked against the variables read
// with Env.URL or Env.URLList.
func TestDocsConfigurationDefaults(t *testing.T) {
	t.Parallel()
	defaults := codeDefaults(t)
	lines, err := markdownLines(filepath.Join(root, "docs", "configuration.md"))
	if err != nil {
		t.Fatal(err)
	}
	compared := 0
	for _, l := range lines {
		m := configDefaultCell.FindStringSubmatch(l.text)
		if m == nil {
			if configRowPattern.MatchString(l.text) {
				t.Errorf("docs/configuration.md:%d: a variable's row without the four cells | name | services | meaning | default | (a | in its text?)", l.n)
			}
			continue
		}
		name, cell := m[1], m[3]
		var who []string
		for svc := range strings.SplitSeq(m[2], ",") {
			who = append(who, strings.TrimSpace(svc))
		}
		if who[0] == "all" {
			who = nil
			for _, a := range apps {
				who = append(who, a.name)
			}
		}
		want := map[string]string{} // service -> the literal documented
		switch {
		case cell == "required":
			for _, svc := range who {
				if !slices.Contains(requiredVars(t, svc), name) {
					t.Errorf("docs/configuration.md:%d: %s is documented as required, and services/%s does not require it", l.n, name, svc)
				}
			}
			continue
		case plainDefault.MatchString(cell):
			for _, svc := range who {
				want[svc] = plainDefault.FindStringSubmatch(cell)[1]
			}
		case perServiceDefault.MatchString(cell):
			for _, sm := range serviceDefault.FindAllStringSubmatch(cell, -1) {
				want[sm[1]] = sm[2]
			}
			if len(want) != len(who) {
				t.Errorf("docs/configuration.md:%d: %s gives defaults for %d services, and is read by %v", l.n, name, len(want), who)
			}
		default:
			continue // prose: what the code computes, or what unset means
		}
		for svc, literal := range want {
			if !slices.Contains(who, svc) {
				t.Errorf("docs/configuration.md:%d: %s gives a default for %s, which the row does not name", l.n, name, svc)
				continue
			}
			if slices.Contains(requiredVars(t, svc), name) {
				t.Errorf("docs/configuration.md:%d: %s has a default, and services/%s requires it", l.n, name, svc)
				continue
			}
			d, ok := defaults[svc][name]
			if !ok {
				t.Errorf("docs/configuration.md:%d: %s defaults to %q for %s, and no constant default of it was found in the code", l.n, name, literal, svc)
				continue
			}
			if err := d.matches(literal); err != nil {
				t.Errorf("docs/configuration.md:%d: %s defaults to %q for %s: %v", l.n, name, literal, svc, err)
			}
			compared++
		}
	}
	// order, invoicing and notification each have a dozen or more.
	if compared < 30 {
		t.Errorf("compared %d documented defaults with the code; the table's default column was not read (has its layout changed?)", compared)
	}
}

// codeDefault is the constant a variable's reader falls back on.
type codeDefault struct {
	value constant.Value
	typ   types.Type
	at    string // file:line of the call
}

// matches reports how literal, as the docs write it, differs from the default, or nil.
func (d codeDefault) matches(literal string) error {
	got := d.value.ExactString()
	var same bool
	switch {
	case types.TypeString(d.typ, nil) == "time.Duration":
		want, err := time.ParseDuration(literal)
		n, exact := constant.Int64Val(d.value)
		got, same = time.Duration(n).String(), err == nil && exact && time.Duration(n) == want
	case d.value.Kind() == constant.String:
		got = constant.StringVal(d.value)
		same = got == literal
	case d.value.Kind() == constant.Bool:
		want, err := strconv.ParseBool(literal)
		same = err == nil && constant.BoolVal(d.value) == want
	case d.value.Kind() == constant.Int:
		want, err := strconv.ParseInt(literal, 10, 64)
		n, exact := constant.Int64Val(d.value)
		same = err == nil && exact && n == want
	default:
		return fmt.Errorf("the code's default %s (%s, %s) is of a kind this test does not compare", got, d.typ, d.at)
	}
	if !same {
		return fmt.Errorf("the code's default is %s (%s)", got, d.at)
	}
	return nil
}

// codeDefaults maps each service to the constant defaults of the variables it reads: those of
// internal/platform's readers, and those of its own package. A variable read with one default
// there and another here is reported: unset, it would mean one value to the one and another to
// the other, where the docs give one default.
func codeDefaults(t *testing.T) map[string]map[string]codeDefault {
	t.Helper()
	const module = "github.com/outboxkit/outbox-inbox"
	platformPath := module + "/internal/platform"
	pkgs := typeCheck(t, "./internal/platform", "./services/...")
	common, ok := pkgs[platformPath]
	if !ok {
		t.Fatalf("go list did not list %s", platformPath)
	}
	shared := envDefaults(t, common, platformPath)
	out := map[string]map[string]codeDefault{}
	for _, a := range apps {
		pkg, ok := pkgs[module+"/services/"+a.name]
		if !ok {
			t.Fatalf("go list did not list services/%s", a.name)
		}
		out[a.name] = map[string]codeDefault{}
		for name, d := range shared {
			out[a.name][name] = d
		}
		for name, d := range envDefaults(t, pkg, platformPath) {
			if common, ok := shared[name]; ok && (common.value.Kind() != d.value.Kind() || !constant.Compare(common.value, token.EQL, d.value)) {
				t.Errorf("services/%s reads %s with the default %s at %s, and internal/platform with %s at %s: unset, it means two things",
					a.name, name, d.value, d.at, common.value, common.at)
			}
			out[a.name][name] = d
		}
	}
	return out
}

// checkedPackage is a package of this repository, parsed and type-checked.
type checkedPackage struct {
	root  string // the repository's, absolute
	fset  *token.FileSet
	files []*ast.File
	info  *types.Info
}

// typeCheck type-checks the packages patterns name, from their sources, their imports read from
// the export data `go list -export` writes (built as the tests are).
func typeCheck(t *testing.T, patterns ...string) map[string]*checkedPackage {
	t.Helper()
	abs, err := filepath.Abs(root)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", append([]string{"list", "-export", "-deps", "-json=ImportPath,Export,Dir,GoFiles,DepOnly"}, patterns...)...)
	cmd.Dir = abs
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -export %v: %v\n%s", patterns, err, stderr.String())
	}
	type listed struct {
		ImportPath, Export, Dir string
		GoFiles                 []string
		DepOnly                 bool
	}
	exports := map[string]string{}
	var targets []listed
	dec := json.NewDecoder(bytes.NewReader(out))
	for dec.More() {
		var p listed
		if err := dec.Decode(&p); err != nil {
			t.Fatalf("go list: %v", err)
		}
		exports[p.ImportPath] = p.Export
		if !p.DepOnly {
			targets = append(targets, p)
		}
	}
	fset := token.NewFileSet()
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		file, ok := exports[path]
		if !ok || file == "" {
			return nil, fmt.Errorf("go list gave no export data for %s", path)
		}
		return os.Open(file)
	})
	pkgs := map[string]*checkedPackage{}
	for _, p := range targets {
		cp := &checkedPackage{root: abs, fset: fset, info: &types.Info{
			Types: map[ast.Expr]types.TypeAndValue{},
			Uses:  map[*ast.Ident]types.Object{},
			Defs:  map[*ast.Ident]types.Object{},
		}}
		for _, f := range p.GoFiles {
			file, err := parser.ParseFile(fset, filepath.Join(p.Dir, f), nil, parser.SkipObjectResolution)
			if err != nil {
				t.Fatal(err)
			}
			cp.files = append(cp.files, file)
		}
		conf := types.Config{Importer: imp}
		if _, err := conf.Check(p.ImportPath, fset, cp.files, cp.info); err != nil {
			t.Fatalf("type-checking %s: %v", p.ImportPath, err)
		}
		pkgs[p.ImportPath] = cp
	}
	return pkgs
}

// envDefaults finds, in pkg, every call of a method of platformPath's Env that takes a
// variable's name and then its default (name, def), and returns the defaults that are
// constants, by variable. ReadCommon's second argument, a constant where a service calls it, is
// HTTP_ADDR's default; in ReadCommon itself that default is its parameter, not a constant.
func envDefaults(t *testing.T, pkg *checkedPackage, platformPath string) map[string]codeDefault {
	t.Helper()
	found := map[string]codeDefault{}
	record := func(name string, arg ast.Expr) {
		tv := pkg.info.Types[arg]
		if tv.Value == nil {
			return
		}
		pos := pkg.fset.Position(arg.Pos())
		file, err := filepath.Rel(pkg.root, pos.Filename)
		if err != nil {
			file = pos.Filename
		}
		d := codeDefault{value: tv.Value, typ: tv.Type, at: fmt.Sprintf("%s:%d", filepath.ToSlash(file), pos.Line)}
		if prev, ok := found[name]; ok && !constant.Compare(prev.value, token.EQL, d.value) {
			t.Errorf("%s is read with the default %s at %s and %s at %s", name, prev.value, prev.at, d.value, d.at)
		}
		found[name] = d
	}
	for _, file := range pkg.files {
		ast.Inspect(file, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) < 2 {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			fn, ok := pkg.info.Uses[sel.Sel].(*types.Func)
			if !ok || fn.Pkg() == nil || fn.Pkg().Path() != platformPath {
				return true
			}
			sig := fn.Signature()
			if sig.Recv() == nil {
				if fn.Name() == "ReadCommon" {
					record("HTTP_ADDR", call.Args[1])
				}
				return true
			}
			recv, _ := sig.Recv().Type().(*types.Pointer)
			if recv == nil || types.TypeString(recv.Elem(), nil) != platformPath+".Env" {
				return true
			}
			if sig.Params().Len() < 2 || sig.Params().At(0).Name() != "name" || sig.Params().At(1).Name() != "def" {
				return true // no default: URL, URLList, Check
			}
			if v := pkg.info.Types[call.Args[0]].Value; v != nil && v.Kind() == constant.String {
				record(constant.StringVal(v), call.Args[1])
			}
			return true
		})
	}
	return found
}

// The file table of docs/deployment.md's Kubernetes section names every file the base's
// kustomization.yaml lists, and monitoring/: a reader of the table sees all that is applied.
func TestDeploymentDocListsK8sFiles(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile(filepath.Join(root, "docs", "deployment.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, _ := strings.Cut(string(doc), "\n## Kubernetes\n")
	section, _, _ = strings.Cut(section, "\n## ")
	var named []string
	for line := range strings.SplitSeq(section, "\n") {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		first, _, _ := strings.Cut(strings.TrimPrefix(line, "| "), " | ")
		for _, m := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(first, -1) {
			named = append(named, m[1])
		}
	}
	if len(named) < 5 {
		t.Fatalf("docs/deployment.md's Kubernetes section: found the files %v in its table; has it moved?", named)
	}
	kust := k8s(t).kust
	for _, file := range slices.Concat(kust.Resources, kust.Generators, []string{"monitoring/"}) {
		if !slices.Contains(named, file) {
			t.Errorf("docs/deployment.md: the Kubernetes section's file table does not name %s, which deploy/k8s applies", file)
		}
	}
}
