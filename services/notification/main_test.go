package main

import (
	"context"
	"strings"
	"testing"

	"github.com/outboxkit/outbox-inbox/internal/platform"
)

// A bad sender setting (SMTP_ADDR's port 0 too, which failed only at the first e-mail) stops the service before it connects to anything, with an error naming
// the variable.
func TestBadSenderSettingsAreNamed(t *testing.T) {
	t.Parallel()
	for _, value := range []string{"0", "1001", "many"} {
		err := run(context.Background(), platform.EnvFrom(map[string]string{
			// Nothing listens there: the service must stop before it tries.
			"DATABASE_URL": "postgres://postgres@127.0.0.1:1/nowhere", "AMQP_URL": "amqp://guest:guest@127.0.0.1:1/",
			"NOTIFY_CONCURRENCY": value, "SMTP_MAX_CONNS": "0", "SMTP_ADDR": "mail:0",
		}))
		if err == nil || !strings.Contains(err.Error(), "NOTIFY_CONCURRENCY: must be an integer from 1 to 1000") ||
			!strings.Contains(err.Error(), "SMTP_MAX_CONNS: must be an integer from 1 to 100") ||
			!strings.Contains(err.Error(), "SMTP_ADDR: port must be a number from 1 to 65535") {
			t.Errorf("NOTIFY_CONCURRENCY=%s SMTP_MAX_CONNS=0 SMTP_ADDR=mail:0: err = %v, want all three named with their ranges", value, err)
		}
	}
}

// SMTP_FROM is the envelope's sender and the From header as written: only a bare address will
// do, not the forms of one that mail.ParseAddress also reads.
func TestASenderAddressThatIsNotBareIsRefused(t *testing.T) {
	t.Parallel()
	for _, value := range []string{"orders@shop.example (Shop)", "Shop: orders@shop.example;", "Shop <orders@shop.example>", "orders"} {
		err := run(context.Background(), platform.EnvFrom(map[string]string{
			"DATABASE_URL": "postgres://postgres@127.0.0.1:1/nowhere", "AMQP_URL": "amqp://guest:guest@127.0.0.1:1/",
			"SMTP_FROM": value,
		}))
		if err == nil || !strings.Contains(err.Error(), "SMTP_FROM: must be a plain e-mail address") {
			t.Errorf("SMTP_FROM=%q: err = %v, want it named", value, err)
		}
	}
}

// NOTIFY_RECIPIENT_DOMAIN is the domain of every recipient derived from a customer id: it must
// be a domain name as SMTP carries it, not merely what mail.ParseAddress reads after an "@".
func TestARecipientDomainThatIsNoDomainNameIsRefused(t *testing.T) {
	t.Parallel()
	label := strings.Repeat("d", 63)
	longest := strings.Join([]string{label, label, label, label[2:]}, ".") // a name of 253 octets: no room for "a@"
	roomy := strings.Join([]string{label, label, label, label[:48]}, ".")  // 240: room for a derived mailbox's "=" and digest
	checkSetting(t, "NOTIFY_RECIPIENT_DOMAIN", "must be a domain name",
		[]string{"shop!", "b_c.example", "-x.example", "[192.0.2.1]", strings.Repeat("d", 64) + ".example", longest, roomy + "d"},
		[]string{roomy, "Customers.Example", "bücher.example"})
}

// SMTP_HELO_NAME follows EHLO as it is: a domain name or an address literal, nothing else a
// server could refuse as syntax at every session.
func TestAHeloNameThatIsNeitherADomainNorALiteralIsRefused(t *testing.T) {
	t.Parallel()
	checkSetting(t, "SMTP_HELO_NAME", "must be a domain name or an address literal",
		[]string{"notification", "mail shop.example", "mail_1.shop.example", "[192.0.2.7", "[2001:db8::1]",
			"[IPv6:192.0.2.7]", "[IPv6:fe80::1%eth0]", "bücher.example", "-mail.shop.example", "192.0.2.7", "mail.123", "mail.shop.example."},
		[]string{"", "mail.shop.example", "xn--bcher-kva.example", "mail.shop4.example", "[192.0.2.7]", "[IPv6:2001:db8::1]", "[ipv6:2001:db8::1]"})
}

// SMTP_FROM goes to servers without SMTPUTF8 too: a domain that is not ASCII as its A-label,
// but a local part that is not ASCII has no such form, nor has every domain, and would fail
// every e-mail there. An ASCII address goes as it is, as any did before the check: a domain
// literal, a name with '_' (refused, they would crash-loop the service on upgrade).
func TestASenderAddressWithNoASCIIFormIsRefused(t *testing.T) {
	t.Parallel()
	checkSetting(t, "SMTP_FROM", "must have an ASCII local part",
		[]string{"örders@shop.example", "orders@shöp_relay.example"},
		[]string{"orders@shöp.example", "orders@Shöp.example", "orders@[192.0.2.1]", "noreply@mail_relay.internal"})
}

// checkSetting runs the service with each value of the setting name: each of refused must end
// the start with an error naming it and saying want, and none of taken may. The run is
// cancelled: a value let through ends it at once, not waiting for the database.
func checkSetting(t *testing.T, name, want string, refused, taken []string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	runWith := func(value string) error {
		return run(ctx, platform.EnvFrom(map[string]string{
			"DATABASE_URL": "postgres://postgres@127.0.0.1:1/nowhere", "AMQP_URL": "amqp://guest:guest@127.0.0.1:1/",
			name: value,
		}))
	}
	for _, value := range refused {
		if err := runWith(value); err == nil || !strings.Contains(err.Error(), name+": "+want) {
			t.Errorf("%s=%q: err = %v, want it named", name, value, err)
		}
	}
	for _, value := range taken {
		if err := runWith(value); err != nil && strings.Contains(err.Error(), name) {
			t.Errorf("%s=%q: err = %v, want it taken", name, value, err)
		}
	}
}
