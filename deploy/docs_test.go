package deploy_test

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
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
