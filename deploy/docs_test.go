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

// docFiles lists README.md and every Markdown file of docs/.
func docFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("docs/ holds no Markdown file")
	}
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
