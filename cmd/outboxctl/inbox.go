package main

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// inboxResult is what inbox show prints in -o json.
type inboxResult struct {
	MessageID uuid.UUID     `json:"message_id"`
	Consumer  *string       `json:"consumer"` // --consumer; null: any
	Handled   bool          `json:"handled"`
	Records   []inboxRecord `json:"records"`
}

type inboxRecord struct {
	Consumer    string    `json:"consumer"`
	ProcessedAt time.Time `json:"processed_at"`
}

func (c *cli) inboxCommand() *cobra.Command {
	var dbFlag, idFlag, consumer string
	show := &cobra.Command{
		Use:   "show --id UUID",
		Short: "was a message handled, by which consumer, and when",
		Long: `show answers "was message X handled by consumer Y, and when?" from the inbox (inbox_messages)
of the consumer's database: the time the transaction of its work began (it committed a
handler's time later), for each consumer that handled it, or for the one --consumer names (the
consumer's name, as its queue). It changes nothing.

No record means not handled, or handled longer ago than the inbox keeps its records
(INBOX_RETENTION, 30 days by default): then it says so and exits with status 3.`,
		Example: `  outboxctl inbox show --id 01a22da8-7b60-74ff-a842-0e78a2a15d84 --consumer invoicing
  outboxctl inbox show --id 01a22da8-7b60-74ff-a842-0e78a2a15d84 -o json`,
		Args: cobra.NoArgs,
		RunE: action(func(ctx context.Context, _ []string) error {
			id, err := parseID(idFlag)
			if err != nil {
				return err
			}
			return c.inboxShow(ctx, dbFlag, id, consumer)
		}),
	}
	dbFlags(show, &dbFlag)
	idFlagFor(show, &idFlag, "the message id")
	show.Flags().StringVar(&consumer, "consumer", "", "the consumer (default: every consumer)")
	return group("inbox", "look up what the inbox recorded", show)
}

func (c *cli) inboxShow(ctx context.Context, dbFlag string, id uuid.UUID, consumer string) error {
	_, db, done, err := openDB(ctx, dbFlag)
	if err != nil {
		return err
	}
	defer done()
	ctx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	records, err := messaging.FindInboxRecords(ctx, db, id, consumer)
	if err != nil {
		return err
	}
	var notHandled error
	if len(records) == 0 {
		notHandled = answered{exitNoMatch}
	}
	if c.json() {
		res := inboxResult{MessageID: id, Handled: len(records) > 0, Records: []inboxRecord{}}
		if consumer != "" {
			res.Consumer = &consumer
		}
		for _, r := range records {
			res.Records = append(res.Records, inboxRecord{Consumer: r.Consumer, ProcessedAt: r.ProcessedAt.UTC()})
		}
		if err := writeJSON(c.out, res); err != nil {
			return err
		}
		return notHandled
	}
	if len(records) == 0 {
		by := "any consumer"
		if consumer != "" {
			by = "consumer " + printable(consumer, 100)
		}
		fmt.Fprintf(c.out, "no record of message %s by %s: not handled, or handled longer ago than the inbox keeps records\n", id, by)
		return notHandled
	}
	for _, r := range records {
		fmt.Fprintf(c.out, "message %s was handled by %s at %s\n", id, printable(r.Consumer, 100), r.ProcessedAt.UTC().Format(time.RFC3339Nano))
	}
	return nil
}
