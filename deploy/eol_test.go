package deploy_test

import (
	"bufio"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"
)

// attrRule is one line of .gitattributes: a pattern and its attributes.
type attrRule struct {
	pattern string
	attrs   []string
}

// A checkout with CRLF line endings (Git for Windows with core.autocrlf) would hand the
// containers files with a CR at the end of every line, which not every reader strips: so every
// file docker-compose.yml bind-mounts, of every profile, is pinned to LF, whatever its format.
func TestComposeMountsArePinnedToLF(t *testing.T) {
	t.Parallel()
	rules := readGitattributes(t)
	abs, _ := filepath.Abs(root)
	for name, s := range loadEveryProfile(t).Services {
		for _, source := range bindMounts(t, s) {
			err := filepath.WalkDir(source, func(p string, d fs.DirEntry, err error) error {
				if err != nil || d.IsDir() {
					return err
				}
				rel, err := filepath.Rel(abs, p)
				if err != nil {
					return err
				}
				if rel = filepath.ToSlash(rel); !lfPinned(rules, rel) {
					t.Errorf("%s mounts %s, which .gitattributes does not pin to eol=lf", name, rel)
				}
				return nil
			})
			if err != nil {
				t.Errorf("%s: %v", name, err)
			}
		}
	}
}

func TestLFPinned(t *testing.T) {
	t.Parallel()
	rules := []attrRule{
		{"*", []string{"text=auto"}},
		{"*.conf", []string{"text", "eol=lf"}},
		{".ci/run", []string{"text", "eol=lf"}},
		{"deploy/raw/*.conf", []string{"binary"}},
	}
	for p, want := range map[string]bool{
		"deploy/rabbitmq/40-cluster.conf": true, "40-cluster.conf": true, ".ci/run": true,
		"deploy/rabbitmq/definitions.json": false, // text=auto alone: the checkout's choice
		"deploy/raw/x.conf":                false, // binary: no conversion at all
		"other/.ci/run":                    false, // a pattern with a slash is from the root
	} {
		if got := lfPinned(rules, p); got != want {
			t.Errorf("lfPinned(%q) = %v, want %v", p, got, want)
		}
	}
}

// readGitattributes reads the repository's .gitattributes, refusing what lfPinned cannot
// evaluate.
func readGitattributes(t *testing.T) []attrRule {
	t.Helper()
	f, err := os.Open(filepath.Join(root, ".gitattributes"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var rules []attrRule
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 || strings.HasPrefix(fields[0], "#") {
			continue
		}
		if strings.Contains(fields[0], "**") || strings.HasPrefix(fields[0], `"`) || strings.HasPrefix(fields[0], "[attr]") {
			t.Fatalf(".gitattributes: %q: ** patterns, quoted patterns and macros are not evaluated here", fields[0])
		}
		rules = append(rules, attrRule{pattern: fields[0], attrs: fields[1:]})
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return rules
}

// lfPinned reports whether rules check the file at p (slash-separated, from the root) out with
// LF endings everywhere: eol=lf, with text not unset. As in git, a pattern without a slash
// matches the file's name at any depth, one with a slash the path from the root, and a later
// line overrides an earlier one.
func lfPinned(rules []attrRule, p string) bool {
	var eol, text string // "" unspecified; text "-" unset
	for _, r := range rules {
		pattern, subject := r.pattern, path.Base(p)
		if strings.Contains(pattern, "/") {
			pattern, subject = strings.TrimPrefix(pattern, "/"), p
		}
		if ok, _ := path.Match(pattern, subject); !ok {
			continue
		}
		for _, a := range r.attrs {
			switch {
			case a == "binary" || a == "-text":
				text = "-"
			case a == "text" || strings.HasPrefix(a, "text="):
				text = a
			case a == "!text":
				text = ""
			case strings.HasPrefix(a, "eol="):
				eol = strings.TrimPrefix(a, "eol=")
			case a == "-eol" || a == "!eol":
				eol = ""
			}
		}
	}
	return eol == "lf" && text != "-"
}
