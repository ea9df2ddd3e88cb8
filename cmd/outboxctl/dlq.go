package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// dlqList prints what waits in QUEUE.dlq, in queue order, and leaves it there.
func dlqList(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlags("dlq list")
	amqpFlag := fs.String("amqp", "", "")
	pos, err := parse(fs, args, "QUEUE")
	if err != nil {
		return err
	}
	cfg, err := deadLetterConfig(*amqpFlag, pos[0])
	if err != nil {
		return err
	}
	listed, err := messaging.ListDeadLetters(ctx, cfg)
	if err != nil {
		return err
	}
	dlq := messaging.DeadLetterQueue(cfg.Queue)
	if len(listed) == 0 {
		fmt.Fprintf(stdout, "%s is empty\n", dlq)
		return nil
	}
	fmt.Fprintf(stdout, "%d messages in %s, in queue order:\n", len(listed), dlq)
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MESSAGE ID\tTYPE\tDEAD-LETTERED AT\tREASON")
	for _, d := range listed {
		at := "-"
		if !d.DeadLetteredAt.IsZero() {
			at = d.DeadLetteredAt.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", printable(d.MessageID, 64), printable(d.Type, 64), at, printable(d.Reason, 300))
	}
	return tw.Flush()
}

// dlqRedrive moves messages from QUEUE.dlq back to QUEUE: all, or those --id names.
func dlqRedrive(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlags("dlq redrive")
	amqpFlag := fs.String("amqp", "", "")
	idFlag := fs.String("id", "", "")
	pos, err := parse(fs, args, "QUEUE")
	if err != nil {
		return err
	}
	var match func(messaging.DeadLetter) bool
	if *idFlag != "" {
		id, err := uuid.Parse(*idFlag)
		if err != nil {
			return usageError{fmt.Sprintf("--id %q is not a UUID", printable(*idFlag, 64))}
		}
		// Parsed, not compared as text: an id written in capitals is the same id.
		match = func(d messaging.DeadLetter) bool {
			got, err := uuid.Parse(d.MessageID)
			return err == nil && got == id
		}
	}
	cfg, err := deadLetterConfig(*amqpFlag, pos[0])
	if err != nil {
		return err
	}
	moved, err := messaging.RedriveDeadLetters(ctx, cfg, match)
	// What moved before a failure moved: say so either way.
	for _, d := range moved {
		fmt.Fprintf(stdout, "redriven %s %s\n", printable(d.MessageID, 64), printable(d.Type, 64))
	}
	dlq := messaging.DeadLetterQueue(cfg.Queue)
	switch {
	case errors.Is(err, messaging.ErrDeadLetterNotFound):
		return fmt.Errorf("no message with id %s in %s", *idFlag, dlq)
	case err != nil:
		return err
	}
	fmt.Fprintf(stdout, "moved %d messages from %s to %s\n", len(moved), dlq, cfg.Queue)
	return nil
}

// deadLetterConfig is the dead-letter queue of queue on the broker --amqp or AMQP_URL names.
func deadLetterConfig(flagValue, queue string) (messaging.DeadLetterConfig, error) {
	amqpURL, err := urlFrom("amqp", flagValue, "AMQP_URL", "amqp", "amqps")
	if err != nil {
		return messaging.DeadLetterConfig{}, err
	}
	return messaging.DeadLetterConfig{URL: amqpURL, Queue: queue, ConnectionName: "outboxctl"}, nil
}
