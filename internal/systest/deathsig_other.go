//go:build !linux

package systest

import "os/exec"

// dieWithTest does nothing: Pdeathsig is Linux's. Elsewhere a process outlives a test binary
// killed before its cleanups ran.
func dieWithTest(*exec.Cmd) {}
