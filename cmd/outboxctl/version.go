package main

import (
	"context"
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/spf13/cobra"
)

// buildVersion is what the binary says of its build: its module's version and, when it was
// built from a checkout with VCS stamping (go build's -buildvcs), the commit.
type buildVersion struct {
	Version  string `json:"version"` // a tag, a pseudo-version, or "(devel)" when the build knew neither
	Revision string `json:"revision,omitempty"`
	Time     string `json:"revision_time,omitempty"`
	Modified bool   `json:"modified,omitempty"` // built with changes not committed
	Go       string `json:"go"`
}

// readVersion reads the build information the go command writes into the binary.
func readVersion() buildVersion {
	v := buildVersion{Version: "(devel)", Go: runtime.Version()}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return v
	}
	if info.Main.Version != "" {
		v.Version = info.Main.Version
	}
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			v.Revision = s.Value
		case "vcs.time":
			v.Time = s.Value
		case "vcs.modified":
			v.Modified = s.Value == "true"
		}
	}
	return v
}

func (v buildVersion) String() string {
	s := v.Version
	if v.Revision != "" {
		s += " (revision " + v.Revision
		if v.Modified {
			s += ", modified"
		}
		s += ")"
	}
	return s + " " + v.Go
}

func (c *cli) versionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "the version of outboxctl, and the commit it was built from",
		Long: `version prints what --version prints: the module version of outboxctl, the VCS revision it
was built from when the build recorded it (go build does in a git checkout, unless
-buildvcs=false), and the Go version. The version is the one the go command recorded for the
module: where it stamped the revision, the pseudo-version derived from it (v0.0.0-...,
ending in +dirty with uncommitted changes; the release tags, pkg/messaging/vX.Y.Z, are the
library's, not this module's), else "(devel)" (go run, the images).`,
		Args: cobra.NoArgs,
		RunE: action(func(context.Context, []string) error {
			v := readVersion()
			if c.json() {
				return writeJSON(c.out, v)
			}
			_, err := fmt.Fprintf(c.out, "outboxctl %s\n", v)
			return err
		}),
	}
}
