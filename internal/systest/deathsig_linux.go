package systest

import (
	"os/exec"
	"syscall"
)

// dieWithTest has the kernel SIGKILL cmd's process when the thread that starts it ends.
func dieWithTest(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
}
