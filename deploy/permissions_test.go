package deploy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// brokerRole is what one service does on the broker, read from its code: the exchange its
// relay publishes to, and the queue its subscription consumes with its bindings.
type brokerRole struct {
	publishes string                      // exchange; "" if the service has no outbox
	consumes  *messaging.ConsumerTopology // nil if the service consumes nothing
}

// The names the services' code passes to the platform, and what they stand for.
var (
	exchangeConsts = map[string]string{"Exchange": events.Exchange, "InvoicingExchange": events.InvoicingExchange}
	eventVars      = map[string]messaging.Binding{
		"OrderPlacedEvent":    {Exchange: events.OrderPlacedEvent.Exchange, RoutingKey: events.OrderPlacedEvent.Type},
		"OrderCancelledEvent": {Exchange: events.OrderCancelledEvent.Exchange, RoutingKey: events.OrderCancelledEvent.Type},
		"InvoiceIssuedEvent":  {Exchange: events.InvoiceIssuedEvent.Exchange, RoutingKey: events.InvoiceIssuedEvent.Type},
	}
)

// brokerRoles reads each service's broker role from services/NAME: base.Outbox(..., events.X,
// ...) names the exchange it publishes to; const Consumer its queue; every
// messaging.Handle(sub, events.XEvent, ...) one binding.
func brokerRoles(t *testing.T) map[string]brokerRole {
	t.Helper()
	outbox := regexp.MustCompile(`\.Outbox\(\s*log,\s*common\.AMQPURL,\s*events\.(\w+),`)
	consumer := regexp.MustCompile(`const Consumer = "([^"]+)"`)
	handle := regexp.MustCompile(`messaging\.Handle\(\s*sub,\s*events\.(\w+),`)
	roles := map[string]brokerRole{}
	for _, a := range apps {
		src := serviceSources(t, a.name)
		var r brokerRole
		if m := outbox.FindStringSubmatch(src); m != nil {
			ex, ok := exchangeConsts[m[1]]
			if !ok {
				t.Fatalf("services/%s publishes to events.%s, which this test does not know: add it to exchangeConsts", a.name, m[1])
			}
			r.publishes = ex
		}
		if m := consumer.FindStringSubmatch(src); m != nil {
			topo := &messaging.ConsumerTopology{Queue: m[1]}
			for _, h := range handle.FindAllStringSubmatch(src, -1) {
				b, ok := eventVars[h[1]]
				if !ok {
					t.Fatalf("services/%s handles events.%s, which this test does not know: add it to eventVars", a.name, h[1])
				}
				topo.Bindings = append(topo.Bindings, b)
			}
			if len(topo.Bindings) == 0 {
				t.Fatalf("services/%s consumes %s but handles no event this test can see", a.name, m[1])
			}
			r.consumes = topo
		}
		if r.publishes == "" && r.consumes == nil {
			t.Fatalf("services/%s neither publishes nor consumes, as far as this test can see (has its main.go changed?)", a.name)
		}
		roles[a.name] = r
	}
	return roles
}

// serviceSources returns the non-test Go files of services/NAME.
func serviceSources(t *testing.T, svc string) string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, "services", svc, "*.go"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no Go files in services/%s (%v)", svc, err)
	}
	var b strings.Builder
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		b.Write(src)
	}
	return b.String()
}

// TestBrokerPermissions applies the permissions of deploy/rabbitmq/definitions.json, exactly
// as written, to a fresh virtual host of the local broker (as users of their own, with test
// passwords), then shows that each service can do what its code does there and is refused
// what belongs to another. It imports the definitions with rabbitmqctl, as the container does
// at boot, so the file's format is checked by a real broker too.
func TestBrokerPermissions(t *testing.T) {
	t.Parallel()
	roles := brokerRoles(t)
	defs := readDefinitions(t)
	// Beside the file's users, invoicing without write on amq.default: the right its queue's
	// dead-letter arguments need, shown by its absence.
	inv, ok := defs.user("invoicing")
	perm, _ := defs.permissions("invoicing", "/")
	noDLX := perm
	noDLX.User, noDLX.Write = "invoicing-without-amq.default", strings.Replace(perm.Write, `|amq\.default`, "", 1)
	if !ok || noDLX.Write == perm.Write {
		t.Fatalf("%s: invoicing's write permission %q does not name amq.default as this test expects", definitionsFile, perm.Write)
	}
	inv.Name = noDLX.User
	defs.Users, defs.Permissions = append(defs.Users, inv), append(defs.Permissions, noDLX)
	users := importForTest(t, defs)
	order, invoicing, notification, outboxctl := users["order"], users["invoicing"], users["notification"], users["outboxctl"]
	for _, u := range []*brokerUser{order, invoicing, notification, outboxctl} {
		if u == nil {
			t.Fatalf("%s lacks one of the users order, invoicing, notification and outboxctl", definitionsFile)
		}
	}
	orders, invoices := roles["order"].publishes, roles["invoicing"].publishes
	invoicingQueue, notificationQueue := roles["invoicing"].consumes.Queue, roles["notification"].consumes.Queue
	if orders == "" || invoices == "" || invoicingQueue == "" || notificationQueue == "" {
		t.Fatalf("the services' roles are not what this test expects: %+v", roles)
	}

	// Before anything exists: a service cannot take another's names.
	order.refused("declare the queue "+invoicingQueue, declareQueue(invoicingQueue))
	order.refused("declare the exchange "+invoices, declareExchange(invoices))
	invoicing.refused("declare the queue "+notificationQueue, declareQueue(notificationQueue))
	outboxctl.refused("declare a queue", declareQueue("outboxctl_scratch"))
	users[noDLX.User].refused("create its queue, whose dead-letter exchange is the default one", declareConsumer(roles["invoicing"].consumes))

	// What each service's code declares when it connects: the relays' exchanges (their
	// publishers' Setup), the subscriptions' topologies (exchanges, dead-letter queue, queue
	// with its dead-letter arguments, bindings).
	for _, name := range []string{"order", "invoicing", "notification"} {
		r, u := roles[name], users[name]
		if r.consumes != nil {
			u.mustAllow("declare its topology (queue "+r.consumes.Queue+", its dead-letter queue and bindings)", declareConsumer(r.consumes))
		}
		if r.publishes != "" {
			u.mustAllow("declare its exchange "+r.publishes, declareExchange(r.publishes))
		}
	}

	// Publishing: each relay to its own exchange, routed to the queues bound to it.
	order.mustAllow("publish OrderPlaced to "+orders, publish(orders, events.OrderPlacedType))
	invoicing.mustAllow("publish InvoiceIssued to "+invoices, publish(invoices, events.InvoiceIssuedType))
	order.refused("publish to "+invoices, publish(invoices, events.InvoiceIssuedType))
	invoicing.refused("publish to "+orders, publish(orders, events.OrderPlacedType))
	notification.refused("publish to "+orders, publish(orders, events.OrderPlacedType))
	notification.refused("publish to "+invoices, publish(invoices, events.InvoiceIssuedType))
	outboxctl.refused("publish to "+orders, publish(orders, events.OrderPlacedType))

	// Consuming: each its own queue only.
	order.refused("consume from "+invoicingQueue, consume(invoicingQueue))
	invoicing.refused("consume from "+notificationQueue, consume(notificationQueue))
	notification.refused("consume from "+messaging.DeadLetterQueue(invoicingQueue), consume(messaging.DeadLetterQueue(invoicingQueue)))

	// Dead-lettering: invoicing rejects the OrderPlaced it got, and the broker moves it to its
	// dead-letter queue (the queue's own arguments, no permission asked); outboxctl takes it
	// from there and puts it back on the queue through the default exchange.
	invoicing.mustAllow("consume from "+invoicingQueue+" and reject a message", func(ch *amqp.Channel) error {
		d, err := next(ch, invoicingQueue)
		if err != nil {
			return err
		}
		if d.Type != events.OrderPlacedType {
			return fmt.Errorf("got a %q, want the OrderPlaced published above", d.Type)
		}
		return d.Reject(false)
	})
	dlq := messaging.DeadLetterQueue(invoicingQueue)
	outboxctl.mustAllow("read the depth of "+dlq, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclarePassive(dlq, true, false, false, false, nil)
		return err
	})
	outboxctl.mustAllow("move the dead-lettered message from "+dlq+" back to "+invoicingQueue, func(ch *amqp.Channel) error {
		d, err := poll(ch, dlq)
		if err != nil {
			return err
		}
		if err := publishOn(ch, "", invoicingQueue, d.Type); err != nil {
			return err
		}
		return d.Ack(false)
	})
	invoicing.mustAllow("consume the moved message from "+invoicingQueue, func(ch *amqp.Channel) error {
		d, err := next(ch, invoicingQueue)
		if err != nil {
			return err
		}
		return d.Ack(false)
	})
	invoicing.mustAllow("publish to its dead-letter queue through the default exchange", publish("", dlq))
	notification.mustAllow("consume OrderPlaced and InvoiceIssued from "+notificationQueue, func(ch *amqp.Channel) error {
		got := map[string]bool{}
		deliveries, err := ch.Consume(notificationQueue, "", false, false, false, false, nil)
		if err != nil {
			return err
		}
		timeout := time.After(15 * time.Second)
		for len(got) < 2 {
			select {
			case d := <-deliveries:
				got[d.Type] = true
				if err := d.Ack(false); err != nil {
					return err
				}
			case <-timeout:
				return fmt.Errorf("got %v within 15 s, want OrderPlaced and InvoiceIssued", got)
			}
		}
		return nil
	})

	// What the file allows beyond each service's needs, because RabbitMQ's permissions are
	// regular expressions over names and cannot tell a queue from an exchange, and because
	// the default exchange reaches every queue (README, "RabbitMQ users and permissions").
	// These pass today; if one fails, the permissions got tighter: update the README too.
	notification.mustAllow("read the queue "+invoicingQueue+" (the name of an exchange it binds from)", func(ch *amqp.Channel) error {
		_, _, err := ch.Get(invoicingQueue, false)
		return err
	})
	notification.mustAllow("publish to any queue through the default exchange (its queue's dead-lettering needs write on it)", publish("", invoicingQueue))
}

// brokerUser is one user of the test's virtual host, connected.
type brokerUser struct {
	t    *testing.T
	name string // as in the definitions file
	conn *amqp.Connection
}

// do runs op on a new channel: a refusal closes the channel, not the connection.
func (u *brokerUser) do(op func(ch *amqp.Channel) error) error {
	ch, err := u.conn.Channel()
	if err != nil {
		u.t.Fatalf("%s: open a channel: %v", u.name, err)
	}
	defer func() { _ = ch.Close() }()
	return op(ch)
}

func (u *brokerUser) mustAllow(what string, op func(ch *amqp.Channel) error) {
	u.t.Helper()
	if err := u.do(op); err != nil {
		u.t.Fatalf("%s may %s, but: %v", u.name, what, err)
	}
}

func (u *brokerUser) refused(what string, op func(ch *amqp.Channel) error) {
	u.t.Helper()
	err := u.do(op)
	var aerr *amqp.Error
	if !errors.As(err, &aerr) || aerr.Code != amqp.AccessRefused {
		u.t.Errorf("%s may not %s, want 403 ACCESS_REFUSED, got: %v", u.name, what, err)
	}
}

func declareExchange(name string) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error {
		return ch.ExchangeDeclare(name, amqp.ExchangeTopic, true, false, false, false, nil)
	}
}

// declareConsumer declares q's exchanges, queue, bindings and dead-letter queue, as a
// consumer's own topology, failing at the first refusal.
func declareConsumer(q *messaging.ConsumerTopology) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error {
		for _, b := range q.Bindings {
			if err := declareExchange(b.Exchange)(ch); err != nil {
				return err
			}
		}
		if _, err := ch.QueueDeclare(q.Queue, true, false, false, false, q.Arguments()); err != nil {
			return err
		}
		for _, b := range q.Bindings {
			if err := ch.QueueBind(q.Queue, b.RoutingKey, b.Exchange, false, nil); err != nil {
				return err
			}
		}
		_, err := ch.QueueDeclare(messaging.DeadLetterQueue(q.Queue), true, false, false, false, q.DeadLetterArguments())
		return err
	}
}

func declareQueue(name string) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclare(name, true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum})
		return err
	}
}

func consume(queue string) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error {
		_, err := ch.Consume(queue, "", false, false, false, false, nil)
		return err
	}
}

// publish publishes one message to exchange with routing key key, typed key too (the
// services' routing key is the event type).
func publish(exchange, key string) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error { return publishOn(ch, exchange, key, key) }
}

// publishOn publishes one persistent, mandatory message and waits for the broker's verdict:
// nil once it is confirmed and routed; the broker's error when it closed the channel instead
// (a refusal); an error when it was returned unroutable.
func publishOn(ch *amqp.Channel, exchange, key, msgType string) error {
	if err := ch.Confirm(false); err != nil {
		return err
	}
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	returned := ch.NotifyReturn(make(chan amqp.Return, 1))
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, amqp.Publishing{
		DeliveryMode: amqp.Persistent, Type: msgType, MessageId: testenv.UniqueName("msg"),
		ContentType: "application/json", Body: []byte(`{}`),
	})
	if err != nil {
		return err
	}
	acked, err := dc.WaitContext(ctx)
	switch {
	case err != nil:
		return fmt.Errorf("no confirm within 15 s: %w", err)
	case acked:
		select {
		case r := <-returned:
			return fmt.Errorf("returned unroutable: %s", r.ReplyText)
		default:
			return nil
		}
	}
	select {
	case e := <-closed:
		if e != nil {
			return e
		}
		return errors.New("the channel closed without a reason")
	case <-ctx.Done():
		return errors.New("nacked, and the channel stays open")
	}
}

// next consumes the first delivery of queue, waiting up to 15 s for it.
func next(ch *amqp.Channel, queue string) (amqp.Delivery, error) {
	if err := ch.Qos(1, 0, false); err != nil {
		return amqp.Delivery{}, err
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return amqp.Delivery{}, err
	}
	select {
	case d, ok := <-deliveries:
		if !ok {
			return amqp.Delivery{}, errors.New("the consumer was cancelled")
		}
		return d, nil
	case <-time.After(15 * time.Second):
		return amqp.Delivery{}, fmt.Errorf("no message in %s within 15 s", queue)
	}
}

// poll gets one message of queue with basic.get, as an operator's tool would, trying until
// one is there or 15 s have passed (dead-lettering is asynchronous).
func poll(ch *amqp.Channel, queue string) (amqp.Delivery, error) {
	deadline := time.Now().Add(15 * time.Second)
	for {
		d, ok, err := ch.Get(queue, false)
		if err != nil || ok {
			return d, err
		}
		if time.Now().After(deadline) {
			return amqp.Delivery{}, fmt.Errorf("no message in %s within 15 s", queue)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// importForTest imports defs into the local broker with every name made the test's own: the
// virtual host / becomes a fresh one, each user NAME becomes NAME_<suffix> with a random
// password, and the permissions stay as written. It returns the users, connected; the virtual
// host and the users are deleted when the test ends.
func importForTest(t *testing.T, defs definitions) map[string]*brokerUser {
	t.Helper()
	vhost := testenv.UniqueName("perms")
	suffix := strings.TrimPrefix(vhost, "perms_")
	test := definitions{VHosts: []defVHost{{Name: vhost}}}
	passwords := map[string]string{}
	for _, u := range defs.Users {
		passwords[u.Name] = testenv.UniqueName("pw")
		test.Users = append(test.Users, defUser{
			Name: u.Name + "_" + suffix, PasswordHash: hashPassword(t, passwords[u.Name]),
			HashingAlgorithm: hashingAlgorithm, Tags: u.Tags,
		})
	}
	for _, p := range defs.Permissions {
		if p.VHost != "/" {
			t.Fatalf("%s: permissions of %s on %q; this test maps the virtual host / only", definitionsFile, p.User, p.VHost)
		}
		p.User, p.VHost = p.User+"_"+suffix, vhost
		test.Permissions = append(test.Permissions, p)
	}
	// Registered first: whatever part of the import happened is removed.
	t.Cleanup(func() {
		for _, args := range append([][]string{{"delete_vhost", vhost}}, usersToDelete(test)...) {
			if out, err := testenv.RabbitMQCtlCommand(append([]string{"-q"}, args...)...).CombinedOutput(); err != nil {
				t.Logf("cleanup: rabbitmqctl %s: %v %s", strings.Join(args, " "), err, out)
			}
		}
	})
	raw, err := json.Marshal(test)
	if err != nil {
		t.Fatal(err)
	}
	cmd := testenv.RabbitMQCtlCommand("-q", "import_definitions")
	cmd.Stdin = bytes.NewReader(raw)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("rabbitmqctl import_definitions (the test's copy of %s): %v\n%s", definitionsFile, err, out)
	}

	base, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	users := map[string]*brokerUser{}
	for name, password := range passwords {
		u := *base
		u.User = url.UserPassword(name+"_"+suffix, password)
		u.Path = "/" + vhost
		conn, err := amqp.DialConfig(u.String(), amqp.Config{Properties: amqp.Table{"connection_name": "permissions-test-" + name}})
		if err != nil {
			t.Fatalf("log in as %s (%s's permissions) to the test's virtual host: %v", name, definitionsFile, err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		users[name] = &brokerUser{t: t, name: name, conn: conn}
	}
	return users
}

func usersToDelete(d definitions) [][]string {
	var args [][]string
	for _, u := range d.Users {
		args = append(args, []string{"delete_user", u.Name})
	}
	slices.SortFunc(args, func(a, b []string) int { return strings.Compare(a[1], b[1]) })
	return args
}
