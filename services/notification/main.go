// Command notification is the notification service: it consumes OrderPlaced, InvoiceIssued
// and OrderCancelled through its inbox, records one notification per order and kind, and
// delivers it after the commit.
package main

import (
	"context"
	"fmt"
	"net/mail"
	"os"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// Consumer is this service's consumer name and queue name.
const Consumer = events.NotificationQueue

func main() { platform.Main("notification", run) }

func run(ctx context.Context, env *platform.Env) error {
	common := platform.ReadCommon(env, ":8082")
	settings := platform.ReadConsumerSettings(env)
	settings.BatchByType = batchByType
	smtpAddr := env.DialAddr("SMTP_ADDR", "")
	smtpFrom := env.String("SMTP_FROM", "orders@shop.example")
	// A comment ("a@b.example (Shop)") or a group ("Shop: a@b.example;") parses as an address
	// too, and would reach MAIL FROM and the From header as it is, refused by strict relays.
	from, fromErr := mail.ParseAddress(smtpFrom)
	plainFrom := fromErr == nil && from.Address == smtpFrom
	env.Check(plainFrom, "SMTP_FROM", "must be a plain e-mail address")
	if plainFrom {
		// Sent to servers without SMTPUTF8 too, as asciiAddress writes it (a domain that is not
		// ASCII as its A-label): a local part or a domain with no ASCII form would fail every
		// e-mail there. An ASCII one goes as it is, as it did before there was this check.
		_, err := asciiAddress(smtpFrom)
		env.Check(err == nil, "SMTP_FROM", "must have an ASCII local part, and a domain with an ASCII form")
	}
	// Every recipient derived from a customer id is at it: a name a server could refuse as
	// syntax would fail each of those e-mails for ever. Kept as its A-label, which a server
	// without SMTPUTF8 takes too.
	domain, isName := asciiDomain(env.String("NOTIFY_RECIPIENT_DOMAIN", "customers.example"))
	env.Check(isName && len(domain) <= maxRecipientDomain, "NOTIFY_RECIPIENT_DOMAIN",
		fmt.Sprintf("must be a domain name, with room for a mailbox at it (%d octets at most as its A-label)", maxRecipientDomain))
	maxBackoff := env.Duration("NOTIFY_MAX_BACKOFF", 5*time.Minute, 2*time.Second, 24*time.Hour)
	// The deliveries hold no database connection: the sender uses one for all of them, whatever
	// NOTIFY_CONCURRENCY is. Nor do they hold an SMTP connection while their outcome is
	// recorded, so more of them than SMTP_MAX_CONNS keep the connections busy.
	concurrency := env.Int("NOTIFY_CONCURRENCY", DefaultConcurrency, 1, 1000)
	smtpConns := env.Int("SMTP_MAX_CONNS", DefaultSMTPConns, 1, 100)
	// Behind a NAT the connection's own address is not the one the server sees, which some
	// servers check the EHLO literal against: the host's public name, given here, is.
	helo := env.String("SMTP_HELO_NAME", "")
	env.Check(validHeloName(helo), "SMTP_HELO_NAME", "must be a domain name or an address literal such as [192.0.2.7]")
	pools := platform.PoolsOf(nil, &settings, 1)
	pools.Check(env, common)
	if err := env.Err(); err != nil {
		return err
	}
	log := platform.NewLogger(os.Stderr, "notification", common.LogFormat, common.LogLevel)
	log.Info("starting", append(append(common.LogAttrs(), settings.LogAttrs()...),
		"smtp_addr", smtpAddr, "smtp_from", smtpFrom, "notify_recipient_domain", domain, "notify_max_backoff", maxBackoff, "notify_concurrency", concurrency, "smtp_max_conns", smtpConns, "smtp_helo_name", helo)...)

	base, err := platform.Start(ctx, log, "notification", common, pools,
		platform.Library(messaging.MigrateInbox), platform.Migrations(migrations, "migrations", "notification_schema"))
	if err != nil {
		return err
	}
	defer base.Close()

	var deliverer Deliverer = logDeliverer{log: log}
	var mailer *smtpDeliverer
	if smtpAddr != "" {
		mailer = newSMTPDeliverer(smtpAddr, smtpFrom, smtpConns)
		mailer.helo = helo
		defer mailer.Close()
		deliverer = mailer
	}
	send := newSender(base.Sender, deliverer, concurrency, maxBackoff, log)
	if err := send.registerMetrics(base.Registry); err != nil {
		return err
	}
	if err := registerBacklog(base.Registry, base.Background, log); err != nil {
		return err
	}

	sub, err := base.Subscription(log, Consumer, common.AMQPURL, events.Topology, settings)
	if err != nil {
		return err
	}
	if err := (notifier{log: log, domain: domain, wake: send.Wake, alreadyDone: base.AlreadyDone(Consumer)}).subscribe(sub); err != nil {
		return err
	}
	return platform.ServeConsumer[Notification](ctx, base, log, common.HTTPAddr, "/notifications", sub, settings,
		platform.Workers{Others: []platform.Worker{sending(send, mailer)}})
}

// sending is the sender's worker: its Run, and, when the e-mails go to a mail server (mailer
// not nil), mailer closed when Run is told to stop, by the signal or by another part's failure:
// a delivery still waiting for a connection then is not started (begun in the grace, it would
// be cut off at its end, maybe after the server took the message).
func sending(send *sender, mailer *smtpDeliverer) platform.Worker {
	if mailer == nil {
		return send.Run
	}
	return func(ctx context.Context) error {
		mailer.closeOnShutdown(ctx)
		return send.Run(ctx)
	}
}
