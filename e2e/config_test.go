package e2e

import (
	"context"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A missing or malformed variable stops a service at once with one line naming it, and never
// prints the password of a URL.
func TestConfigurationErrorsNameTheVariable(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3t-pa55"
	valid := map[string]string{
		"DATABASE_URL": "postgres://u:" + secret + "@127.0.0.1:1/db",
		"AMQP_URL":     "amqp://u:" + secret + "@127.0.0.1:1/",
	}
	cases := []struct {
		service, variable, value string
	}{
		{"order", "DATABASE_URL", ""},
		{"order", "DATABASE_URL", "mysql://u:" + secret + "@h/db"},
		{"order", "AMQP_URL", ""},
		{"order", "AMQP_URL", "not a url " + secret},
		{"order", "OUTBOX_BATCH_SIZE", "lots"},
		{"order", "OUTBOX_LANES", "0"},
		{"order", "OUTBOX_POLL_INTERVAL", "1 second"},
		{"order", "OUTBOX_MAX_BACKOFF", "1ms"},
		{"order", "LOG_LEVEL", "loud"},
		{"order", "LOG_FORMAT", "xml"},
		{"invoicing", "DATABASE_URL", ""},
		{"invoicing", "CONSUMER_CONCURRENCY", "0"},
		{"notification", "AMQP_URL", "http://u:" + secret + "@h/"},
		{"notification", "NOTIFY_MAX_BACKOFF", "forever"},
	}
	for _, c := range cases {
		env := []string{"PATH=/usr/bin:/bin"}
		for k, v := range valid {
			if k != c.variable {
				env = append(env, k+"="+v)
			}
		}
		if c.value != "" {
			env = append(env, c.variable+"="+c.value)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		cmd := exec.CommandContext(ctx, filepath.Join(binDir, c.service))
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		cancel()
		text := strings.TrimSpace(string(out))
		var exit *exec.ExitError
		if err == nil || !errors.As(err, &exit) || exit.ExitCode() != 1 {
			t.Errorf("%s with %s=%q: %v, want exit status 1", c.service, c.variable, c.value, err)
		}
		if strings.Count(text, "\n") != 0 || !strings.HasPrefix(text, c.service+": config: ") || !strings.Contains(text, c.variable) {
			t.Errorf("%s with %s=%q printed %q, want one line naming %s", c.service, c.variable, c.value, text, c.variable)
		}
		if strings.Contains(text, secret) {
			t.Errorf("%s printed a secret: %q", c.service, text)
		}
	}
}
