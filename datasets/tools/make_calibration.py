#!/usr/bin/env python3
"""Generate datasets/calibration.jsonl: business-domain prose for quantization calibration.

Deterministic: the same seed always writes the same file. Every document is composed from the
hand-written template bank below (no benchmark or third-party text): a document type is chosen
(report, memo, customer email, policy, minutes, product sheet, incident review, contract
explanation, finance commentary, project status, supplier evaluation, support article, HR
notice, proposal summary), its sections are filled with sentences drawn without replacement
from that type's banks, and slots are filled with fictional names, numbers and dates that stay
consistent inside one document.  ``[a|b|c]`` in a template picks one alternative; ``{slot}``
is filled from the document context or drawn fresh.

Usage:
    python datasets/tools/make_calibration.py [--out datasets/calibration.jsonl] [--n 288] [--seed 20240611]
                                              [--check]   # print word-count and overlap statistics
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

SEED = 20240611
N_DOCS = 288
MIN_WORDS = 180
MAX_WORDS = 750

# ------------------------------------------------------------------------------------------
# name banks (all fictional)
# ------------------------------------------------------------------------------------------
COMPANIES = [
    "Northfield Packaging", "Corvane Systems", "Ashgrove Foods", "Tidewell Logistics", "Kestrel Analytics",
    "Bramblecote Textiles", "Orrin Medical Supplies", "Vantor Energy Services", "Millhaven Print Group",
    "Quarryside Building Products", "Lumen Harbor Software", "Deepwell Water Solutions", "Pellworth Insurance Brokers",
    "Greystone Facilities", "Halden Marine Parts", "Silverbirch Hospitality", "Coppervale Electronics",
    "Fenwick & Rowe Consulting", "Brightmoor Retail", "Oakhurst Dental Labs", "Stellan Freight",
    "Wrenfield Agritech", "Marlow Street Bakeries", "Ironbridge Tooling", "Calder Valley Dairy",
    "Pinecrest Home Care", "Harbourlight Telecom", "Rookwood Office Interiors", "Elmstead Pharmacy Group",
    "Sablewood Furniture", "Thornbury Security", "Aldercroft Engineering", "Glenmere Travel", "Nettlebed Robotics",
    "Bluehaven Pet Supplies", "Westmarch Credit Union", "Crestline Solar", "Dunmore Cold Storage",
    "Larkspur Learning", "Redfern Auto Components",
]
FIRST = [
    "Amira", "Ben", "Chloe", "Daniel", "Elena", "Farid", "Grace", "Hugo", "Isla", "Jonas", "Keiko", "Liam",
    "Maya", "Nikhil", "Olivia", "Pavel", "Quinn", "Rosa", "Samuel", "Tariq", "Una", "Victor", "Wen", "Xavier",
    "Yasmin", "Zoe", "Aidan", "Bianca", "Callum", "Dina", "Emeka", "Freya", "Gustavo", "Hana", "Imran", "Jade",
    "Kofi", "Lena", "Marco", "Nadia", "Oscar", "Priya", "Rafael", "Sofia", "Tomasz", "Ursula", "Vikram", "Willa",
]
LAST = [
    "Okafor", "Lindqvist", "Harcourt", "Moreau", "Tanaka", "Brennan", "Castillo", "Novak", "Adeyemi", "Fairburn",
    "Kowalski", "Mensah", "Delacroix", "Whitlock", "Sandoval", "Petrov", "Achterberg", "Quayle", "Rasmussen",
    "Nakamura", "Oduya", "Pemberton", "Iqbal", "Varga", "Holloway", "Esposito", "Grunwald", "Marsh", "Chaudhry",
    "Lindgren", "Obi", "Farrow", "Szabo", "Ellery", "Kimura", "Dunleavy", "Ferreira", "Haddad", "Voss", "Ashby",
]
ROLES = [
    "Operations Director", "Head of Finance", "Customer Service Manager", "Plant Manager", "Procurement Lead",
    "HR Business Partner", "IT Service Manager", "Quality Manager", "Account Director", "Product Manager",
    "Logistics Coordinator", "Facilities Manager", "Commercial Director", "Compliance Officer",
    "Project Manager", "Chief Executive", "Sales Manager", "Data Protection Officer", "Warehouse Supervisor",
    "Financial Controller", "Engineering Manager", "Head of People", "Support Team Lead", "Site Lead",
]
DEPTS = [
    "Finance", "Operations", "Customer Service", "Procurement", "Human Resources", "IT", "Quality", "Sales",
    "Marketing", "Logistics", "Facilities", "Legal", "Engineering", "Product", "Warehouse", "Compliance",
]
PRODUCTS = [
    "Atlas 300 pump controller", "Meridian cloud invoicing service", "Halo desk lamp", "TrackPoint fleet tracker",
    "ClearFlow water filter", "Summit ergonomic chair", "Pulse patient monitor", "Keystone access badge system",
    "NovaPrint label printer", "Harvest Gold granola", "Beacon smart thermostat", "Vela travel insurance plan",
    "Orbit conference speaker", "Forge cordless drill", "Tern folding bicycle", "LedgerLite accounting package",
    "Aurora LED panel", "Cobalt payroll module", "Sentinel door sensor", "Riverstone cold brew",
    "Quill document scanner", "Mosaic floor tiles", "Drift noise-cancelling headset", "Granite server rack",
    "Cirrus air purifier", "Lattice shelving unit", "PocketPay card reader", "Wayfarer backpack",
]
SITES = [
    "Easton", "Millbrook", "Ravensford", "Harlow Park", "Kingsmere", "Ashford Quay", "Port Alder", "Coldwater",
    "Briarwood", "Stonebridge", "Fairhaven", "Westcliff", "Oxley Green", "Hollins Cross", "Lowmoor", "Redhill",
]
REGIONS = ["North", "South", "East", "West", "Central", "Northern Europe", "Iberia", "Nordics", "Midlands", "Benelux"]
SYSTEMS = [
    "ERP system", "warehouse management system", "ticketing platform", "CRM", "payroll system",
    "customer portal", "billing platform", "maintenance scheduler", "document management system", "HR portal",
]
PROJECTS = [
    "Project Lighthouse", "Project Keel", "Project Juniper", "Project Northstar", "Project Harbour",
    "Project Tessera", "Project Falcon", "Project Willow", "Project Anvil", "Project Meadow", "Project Quartz",
    "Project Compass", "Project Ember", "Project Orchard", "Project Tide",
]
CURRENCIES = [("£", "pounds"), ("$", "dollars"), ("€", "euros")]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
TOPICS = [
    "late deliveries", "invoice errors", "rising energy costs", "staff turnover", "the new returns process",
    "supplier lead times", "data quality", "overtime levels", "customer onboarding", "stock accuracy",
    "response times", "warranty claims", "contract renewals", "training completion", "credit control",
]

# ------------------------------------------------------------------------------------------
# shared sentence banks
# ------------------------------------------------------------------------------------------
G_NUMBERS = [
    "Compared with the same period last year, the figure [rose|improved] by {pct}, although most of the gain came in the final {weeks} weeks.",
    "The [headline|overall] number hides a wide spread between sites, with {site} at {pct} and {site2} well behind.",
    "We [processed|handled|completed] {bignum} transactions, of which {pct} needed some form of manual correction.",
    "Average handling time [fell|dropped] from {mins} minutes to {mins2} minutes after the new checklist was introduced.",
    "Spending came in at {money}, which is {pct} [below|under] the approved budget.",
    "The backlog stood at {num} open items at the end of the period, down from {num2} a month earlier.",
    "[Roughly|About|Nearly] {pct} of the variance can be traced to a single large order that slipped into the following month.",
    "Unit costs [increased|went up] by {pct_small} because of higher freight and packaging prices.",
    "The team closed {num} of the {num2} actions raised at the last review, and the rest have agreed dates.",
    "Productivity, measured as output per paid hour, [improved|increased] by {pct_small} over the quarter.",
    "Days sales outstanding moved from {days} to {days2} days, which released about {money_small} of cash.",
    "The error rate on [orders|invoices|shipments] is now {pct_small}, the lowest figure since we began measuring it.",
    "We expect the figure to settle at around {pct} once seasonal effects are taken into account.",
    "A sample audit of {num} records found {num_small} with missing or inconsistent data.",
    "Throughput at {site} averaged {num} units per shift, against a plan of {num2}.",
    "Once the one-off items are removed, the underlying trend is flat.",
    "The share of work completed right first time reached {pct_high}, up from {pct2} a year earlier.",
    "Queue times at peak hours doubled in {month}, before falling back once the extra shift was added.",
    "Write-offs for damaged or obsolete stock totalled {money_small}, close to the historical average.",
    "The figures for {site2} should be treated with caution, because the site changed its counting method mid-period.",
]
G_RISK = [
    "The main risk is that supplier lead times lengthen again, which would [delay|push back] the {month} deliveries.",
    "If demand from {customer} falls below forecast, we may need to reduce temporary staffing at {site}.",
    "There is a risk that key knowledge sits with only one or two people, so we are documenting the process in detail.",
    "Exchange-rate movements remain a risk for purchases priced in foreign currency.",
    "We are watching the {system} closely, because another outage during month-end would delay invoicing.",
    "Recruitment for specialist roles is slower than planned, and two vacancies have been open for more than {weeks} weeks.",
    "The contract with {supplier} expires in {month}, and renewal terms have not yet been agreed.",
    "A further increase in energy prices would add roughly {money_small} per month to operating costs.",
    "The project depends on [IT|Finance|Legal] resources that are also committed to year-end work.",
    "Regulatory guidance in this area is still changing, so we have asked {person3} to track updates monthly.",
    "Customer expectations on delivery speed keep rising, and our current network was not designed for next-day service.",
    "Ageing equipment at {site} has broken down {num_small} times this year, and spare parts are getting harder to find.",
    "A cyber incident at a supplier could interrupt deliveries, so we have asked our key suppliers about their controls.",
    "Wage inflation in the local labour market is running ahead of our budget assumption.",
    "Our reliance on {customer} for a large share of revenue leaves us exposed if their plans change.",
    "Insurance premiums are due for renewal in {month} and may rise sharply.",
]
G_ACTIONS = [
    "{p1_first} will [circulate|share] a revised plan by {date}, including costs and a timeline.",
    "[We will|The team will] review progress at the next monthly meeting and adjust targets if needed.",
    "By the end of {month}, every team leader will have completed the new training module.",
    "{p2_first} has agreed to run a short pilot at {site} before the change is rolled out elsewhere.",
    "We will report the results to the leadership team on {date}.",
    "A working group of {num_small} people from {dept} and {dept2} will look at options and present a recommendation.",
    "The updated procedure will be published on the intranet and linked from the {system}.",
    "Managers are asked to confirm their teams' figures by {weekday} so that the consolidated report can go out on time.",
    "We will contact the {num_small} customers most affected individually rather than relying on a general notice.",
    "{person3} will own the follow-up and report weekly until the issue is closed.",
    "Budget for the next phase, estimated at {money}, will be requested at the {month} investment committee.",
    "We plan to measure the effect again after {weeks} weeks and share the results with everyone involved.",
    "A simple dashboard showing the key measures will be available to all managers from {date}.",
    "{p1_first} and {p2_first} will meet the main suppliers next month to agree a joint improvement plan.",
    "We will pause the change if any of the early warning measures move the wrong way.",
    "The lessons from this exercise will be added to the induction programme for new managers.",
    "Each site will appoint a champion to answer questions and collect feedback during the first month.",
]
G_PEOPLE = [
    "I would like to thank the {dept} team, who worked through several weekends to get this done.",
    "{p2_first} joined us in {month} as {role2} and has already made a noticeable difference.",
    "Absence was higher than usual in {month}, mainly because of seasonal illness.",
    "Staff feedback on the change has been mostly positive, although some people asked for clearer instructions.",
    "We welcomed {num_small} new colleagues this period, and their induction is on track.",
    "Several team members have volunteered to act as coaches for colleagues who are new to the {system}.",
    "The engagement survey response rate reached {pct_high}, the highest we have seen.",
    "Two long-serving colleagues at {site} retired this period, and we thank them for their many years of service.",
    "Internal promotions filled {num_small} of the last ten supervisor vacancies.",
    "Mandatory training completion stands at {pct_high}, with the remaining sessions booked for next month.",
    "Team leaders have started short daily huddles, which staff say help them plan the day.",
    "We are reviewing shift patterns after colleagues told us that the current rota makes childcare difficult.",
]
G_CUSTOMER = [
    "{customer} told us that the faster response times have made a real difference to their own planning.",
    "Customer complaints fell to {num_small} this month, and none of them related to product quality.",
    "Two customers asked for more detailed delivery tracking, which we are now scoping.",
    "Feedback from the customer survey was broadly positive, with an average score of {score} out of ten.",
    "We lost one small account to a competitor on price, but retained all of our top {num_small} customers.",
    "{customer} has asked to extend the pilot to two more sites, which would increase annual volume significantly.",
    "Customers continue to value clear communication about delays more than the delays themselves.",
    "Repeat orders from existing accounts made up {pct} of sales, a sign that service levels are holding.",
    "One large customer has asked us to report carbon emissions per delivery from next year.",
    "The number of customers using the online portal grew to {bignum}.",
    "Complaints about invoice accuracy have almost disappeared since the billing changes in {month}.",
    "We visited {num_small} key accounts in person this quarter to review service and gather feedback.",
]
G_CLOSING = [
    "If you have any questions, please contact {person} directly.",
    "Thank you for your continued support and hard work.",
    "We will share a further update once the review is complete.",
    "Please read this note carefully and pass it on to anyone in your team who does not have email access.",
    "Further details are available from the {dept} team.",
    "Your feedback is welcome and will help us improve the next version.",
]
G_SUSTAIN = [
    "Electricity use fell by {pct_small} after the lighting upgrade at {site}.",
    "We now buy {pct_high} of our electricity on renewable tariffs.",
    "Waste sent to landfill fell again, as more packaging was returned to suppliers for reuse.",
    "A trial of electric delivery vans around {site} will run until {month}.",
    "Customers increasingly ask for environmental data in tenders, and we have started collecting it systematically.",
    "Water use per unit of output was flat, although a leak at {site2} was found and repaired in {month}.",
]
G_TECH = [
    "The {system} was available {pct_high} of working hours, with one unplanned outage.",
    "Multi-factor authentication is now in place for all office users.",
    "We retired {num_small} old applications whose functions are now covered by the {system}.",
    "A phishing exercise found that {pct_small} of staff clicked the test link, down from last time.",
    "Reports that used to take a day to prepare by hand are now produced automatically each morning.",
    "Support tickets raised with IT were resolved in an average of {hours} hours.",
]
GENERAL = {"sustain": G_SUSTAIN, "tech": G_TECH, "numbers": G_NUMBERS, "risk": G_RISK, "actions": G_ACTIONS, "people": G_PEOPLE,
           "customer": G_CUSTOMER, "closing": G_CLOSING}

# ------------------------------------------------------------------------------------------
# document types: title templates, optional meta lines, sections
# section = (heading alternatives, style "para"|"bullets", own bank, fallback general bank)
# ------------------------------------------------------------------------------------------
T_REPORT = {
    "titles": ["{company}: Quarterly Business Report, {quarter} {year}", "{quarter} {year} Performance Report for {company}",
               "{company} Operations Update, {quarter} {year}"],
    "meta": ["Prepared by {person}, {role1}", "Distribution: leadership team and site managers"],
    "sections": [
        (["Summary", "Executive Summary", "Overview"], "para", [
            "This report summarises the performance of {company} during {quarter} {year} and sets out our priorities for the next quarter.",
            "It was a [mixed|steady|challenging|strong] quarter: revenue reached {money}, while operating costs were {pct_small} above plan.",
            "The most important development was the launch of the {product}, which exceeded its first-quarter sales target.",
            "Order intake [recovered|improved] after a slow start, helped by a large framework order from {customer}.",
            "Service levels held up well despite the disruption caused by the {system} upgrade in {month}.",
            "In short, we are ahead of plan on sales, behind plan on costs, and broadly on track for the full year.",
            "Margins held up better than expected, although freight and labour costs continue to squeeze them.",
            "Two of our [three|four] sites beat their efficiency targets, while {site2} struggled with staff shortages.",
            "Cash generation was healthy, and we ended the quarter with no borrowing under the revolving facility.",
        ], "numbers"),
        (["Revenue and Orders", "Sales Performance", "Demand"], "para", [
            "Revenue for the quarter was {money}, an increase of {pct} on the same quarter last year.",
            "The {region} region grew fastest, while sales in {region2} were flat because of a delayed retail promotion.",
            "New customers accounted for {pct} of orders, up from {pct2} a year ago.",
            "Average order value [rose|increased] to {money_small} as customers moved to larger pack sizes.",
            "The pipeline for next quarter contains {num} qualified opportunities with a combined value of {money}.",
            "Price increases introduced in {month} were accepted by most customers without significant pushback.",
            "We saw some customers delay orders until the new financial year, which shifted about {money_small} of revenue.",
            "Online orders now represent {pct} of the total, continuing the steady shift away from phone and email.",
            "Sales of older product lines declined as expected, and we plan to withdraw {num_small} of them next year.",
            "Distributor sales were weaker than direct sales, mainly because two distributors reduced their stock levels.",
            "Export orders rose to {pct} of revenue, helped by a new agent in the {region2} region.",
            "Win rates on competitive tenders improved to {pct}, from {pct2} in the previous quarter.",
        ], "customer"),
        (["Operations", "Operational Performance", "Delivery and Service"], "para", [
            "On-time delivery averaged {pct_high}, against a target of {pct_target}.",
            "The {site} site completed its move to a two-shift pattern, which increased capacity by about {pct}.",
            "Stock accuracy improved after we introduced weekly cycle counts for high-value items.",
            "A shortage of packaging materials in {month} caused some short shipments, which were completed within {days} days.",
            "The number of customer returns fell to {num}, mostly because of better checks at the packing stage.",
            "Planned maintenance was completed on schedule at all sites, and unplanned downtime was below {pct_small}.",
            "We began reporting delivery performance by customer rather than by site, which gives a clearer picture.",
            "Lead times from order to dispatch shortened to {days2} hours for standard items.",
            "The {site2} warehouse was reorganised over two weekends so that fast-moving items sit closest to the packing benches.",
            "Safety performance was good, with no lost-time injuries and {num_small} near misses reported and investigated.",
            "Quality audits at {site} found only minor issues, all of which were closed within the month.",
        ], "numbers"),
        (["Costs", "Cost Performance", "Spending"], "para", [
            "Operating costs were {money}, {pct_small} higher than plan, mainly because of overtime and agency staff.",
            "Freight costs rose as carriers added fuel surcharges, though renegotiated rates from {month} will offset part of this.",
            "Energy spending was below budget thanks to the fixed-price contract agreed last year.",
            "Headcount costs were in line with plan, although two senior vacancies remain unfilled.",
            "We have identified savings of about {money_small} per quarter from consolidating software licences.",
            "Capital spending was {money_small}, mostly on equipment at {site} that had been approved in the annual budget.",
            "Insurance and professional fees were slightly above plan because of a one-off legal review.",
            "Agency staff costs fell in the last month of the quarter as permanent recruits completed their training.",
            "We renegotiated the cleaning and security contracts, saving about {money_small} a year from next quarter.",
        ], "risk"),
        (["Outlook", "Priorities for Next Quarter", "Looking Ahead"], "para", [
            "We expect revenue to grow by {pct_small} next quarter as the {product} reaches more customers.",
            "Our first priority is to bring overtime back within the agreed limit of {pct_small} of paid hours.",
            "We will also complete the rollout of the new {system} to the remaining sites.",
            "Cost control will remain a focus, particularly freight and temporary labour.",
            "The full-year forecast is unchanged, although the range of outcomes has narrowed.",
            "We will start planning for the peak season earlier this year, with temporary staff booked by {month}.",
            "A review of our product range will report in {month}, with recommendations on which lines to keep.",
            "We will keep a close eye on customer payment behaviour, which is an early sign of wider economic stress.",
        ], "actions"),
    ],
}
T_MEMO = {
    "titles": ["Memo: Changes to {topic_title}", "Internal Memo: {topic_title}", "Memorandum: Update on {topic_title}"],
    "meta": ["To: All staff in {dept} and {dept2}", "From: {person}, {role1}", "Date: {date}", "Subject: {topic}"],
    "sections": [
        (["Purpose"], "para", [
            "This memo explains a change to how we handle {topic}, which takes effect on {date}.",
            "The purpose of this note is to confirm the decisions taken at last week's management meeting about {topic}.",
            "I am writing to set out a short-term plan for dealing with {topic} over the next {weeks} weeks.",
            "This memo replaces the guidance issued in {month} and should be read by every team leader.",
            "Please read it before the team briefing on {weekday}, when there will be time for questions.",
            "The changes described below were agreed by the leadership team on {date}.",
        ], None),
        (["Background", "Why We Are Making This Change", "Context"], "para", [
            "Over the past {months} months we have seen a steady increase in problems linked to {topic}.",
            "An internal review found that {pct} of cases were handled differently depending on which team received them.",
            "Customers have told us that they find our current process slow and hard to follow.",
            "The current approach was designed when the business was about half its present size.",
            "Auditors raised this area as a finding in their last visit and asked us to tighten our controls.",
            "We also want to reduce the amount of manual re-keying between the {system} and spreadsheets.",
            "Several colleagues suggested improvements through the staff suggestion scheme, and many of them are reflected here.",
            "The cost of handling each case has risen to around {money_small} a year in staff time alone.",
            "Other companies of our size have moved to a simpler, single-queue approach with good results.",
            "Delays in one team often create extra work for another, which is frustrating for everyone involved.",
        ], "numbers"),
        (["What Is Changing", "The New Process", "Decisions"], "para", [
            "From {date}, all requests must be logged in the {system} before any work begins.",
            "Approvals above {money_small} will now need sign-off from a second manager.",
            "Each team will nominate a single point of contact who will own queries about {topic}.",
            "We will stop accepting requests by email, except in genuine emergencies.",
            "The weekly review meeting moves from {weekday} to {weekday2} mornings so that the latest figures are available.",
            "Standard response times will be {hours} working hours for routine requests and two hours for urgent ones.",
            "The old shared spreadsheet will be archived and made read-only at the end of {month}.",
            "Exceptions to the new rules must be recorded, with a short reason, so that we can learn from them.",
            "Routine requests will be handled in the order received, with urgent cases flagged by the requester.",
            "A monthly summary of volumes and response times will be shared with all teams.",
            "Templates for the most common requests are available in the {system} to save time.",
        ], "actions"),
        (["What This Means for You", "Next Steps", "Your Role"], "para", [
            "Please make sure that you have access to the {system}; if not, raise a request with IT this week.",
            "Team leaders should brief their teams before {date} and confirm to {p1_first} once this is done.",
            "A short training session will run on {weekday} at {clock} and will be recorded for those who cannot attend.",
            "Nobody's role is changing as a result of this memo, although some tasks will move between teams.",
            "If you think the new process will not work for a particular case, please say so early rather than working around it.",
            "We will review how the change is working after {weeks} weeks and adjust it if needed.",
            "Thank you in advance for your help in making this change work smoothly.",
        ], "closing"),
    ],
}
T_EMAIL = {
    "titles": ["Subject: Your order {order} with {company}", "Subject: Re: Delivery query for order {order}",
               "Subject: Update on your account {account}", "Subject: Follow-up to our call on {date}"],
    "meta": [],
    "greeting": ["Dear {c_first},", "Hello {c_first},", "Dear {c_full},"],
    "sections": [
        (None, "para", [
            "Thank you for getting in touch about order {order}, and I am sorry for the inconvenience this has caused.",
            "Thank you for your patience while we looked into the problem with your recent delivery.",
            "I am writing to follow up on our conversation on {date} about your account.",
            "Thank you for your email of {date}, which our team received this morning.",
            "I appreciate you taking the time to explain the issue in such detail.",
            "I am sorry that you had to contact us more than once about this matter.",
            "Please accept our apologies for the delay in replying to your message.",
            "I have now had a chance to review your account and the notes from your earlier calls.",
        ], "customer"),
        (None, "para", [
            "Having checked our records, I can confirm that {num_small} items from the order were left in our {site} warehouse because of a labelling error.",
            "The delay was caused by a problem with our carrier's sorting centre, which affected several hundred parcels on {weekday}.",
            "Our records show that the invoice was issued at the old price, which should have been updated on {date}.",
            "The {product} you received was from a batch that we have since withdrawn after a small number of similar reports.",
            "It appears that the payment was applied to the wrong account number, which is why you received a reminder.",
            "Your subscription renewed automatically because the cancellation request did not reach our billing team.",
            "We have confirmed that the fault lies with us and not with the way the product was installed.",
            "A change to our delivery schedule in {month} meant that your area was served on a different day, and we did not tell you in advance.",
            "The discount agreed with your account manager was not entered on the system, so the invoice showed the full price.",
            "Part of your order was held back because one item was out of stock, and the notification email did not reach you.",
            "The product code on your order was mistyped, which is why a different item was sent.",
        ], "numbers"),
        (None, "para", [
            "I have arranged for the missing items to be sent by express delivery, and they should arrive by {weekday}.",
            "We have issued a credit note for {money_small}, which will appear on your next statement.",
            "A replacement {product} has been dispatched today, and a courier will collect the faulty unit at the same time.",
            "I have corrected the account and cancelled the reminder, so no further action is needed on your side.",
            "As a gesture of goodwill, we have also waived the delivery charge on your next order.",
            "We will refund the full amount of {money_small} to your original payment method within {days} working days.",
            "Your account manager, {person2}, will call you on {weekday} to confirm that everything is in order.",
            "I have added a note to your account so that future orders are checked by a supervisor before dispatch.",
            "The corrected invoice is attached to this email, showing the agreed price and a revised due date.",
            "We have booked a delivery slot for {weekday} morning, and the driver will call ahead.",
            "I have asked our warehouse team to check all open orders on your account for the same problem.",
        ], "actions"),
        (None, "para", [
            "If anything is still not right, please reply to this email or call me directly on {phone}.",
            "Please keep this email for your records, and quote reference {ticket} if you need to contact us again.",
            "Thank you again for your patience, and for being a customer of {company}.",
            "We value your business and hope this resolves the matter to your satisfaction.",
            "If it would help, I am happy to arrange a call at a time that suits you.",
            "I will check back with you next week to make sure everything has arrived.",
        ], "closing"),
    ],
    "signoff": ["Kind regards,\n{person}\n{role1}, {company}", "Best regards,\n{person}\n{company} Customer Service",
                "Yours sincerely,\n{person}\n{role1}"],
}
T_POLICY = {
    "titles": ["{company} {policy_name} Policy", "{policy_name} Policy (Version {version})", "Policy: {policy_name}"],
    "meta": ["Owner: {person}, {role1}", "Effective date: {date}", "Next review: {month} {year_next}"],
    "sections": [
        (["Purpose"], "para", [
            "This policy sets out how {company} manages {policy_lower} and the responsibilities of everyone involved.",
            "Its aim is to protect the company, our employees and our customers while keeping processes simple.",
            "The policy reflects legal requirements as well as the standards our customers expect of us.",
            "It replaces all earlier guidance on {policy_lower}, including local procedures at individual sites.",
            "The policy is written to be practical: where a rule seems unclear, follow its intention and ask for advice.",
            "It supports our commitment to treat customers, suppliers and colleagues fairly and openly.",
        ], None),
        (["Scope"], "para", [
            "The policy applies to all employees, contractors and temporary staff, at every site and when working remotely.",
            "It covers activities carried out on behalf of {company}, whether or not they take place during normal working hours.",
            "Subsidiaries that have their own policy must make sure it is at least as strict as this one.",
            "Suppliers who act on our behalf are expected to follow equivalent rules, as set out in their contracts.",
            "Members of the board are also covered, and any exception for them must be approved by the chair.",
            "Agency workers are covered from their first day on site, and their agencies are told about the policy.",
        ], None),
        (["Policy Statements", "Rules", "Requirements"], "bullets", [
            "Expenses must be claimed within {days} days and supported by an itemised receipt.",
            "Any gift or hospitality worth more than {money_small} must be recorded in the register within five working days.",
            "Personal data may only be stored in approved systems, and never on personal devices or unapproved cloud services.",
            "Passwords must not be shared, and multi-factor authentication must be used wherever it is available.",
            "Employees must report suspected breaches of this policy to their manager or to the {role3} without delay.",
            "Travel must be booked through the approved agency unless a cheaper option is documented in advance.",
            "Conflicts of interest must be declared at the start of any procurement process.",
            "Requests for flexible working will be answered in writing within {days} days.",
            "Confidential documents must be stored in locked cabinets or encrypted folders when not in use.",
            "Managers must complete a risk assessment before approving any new remote working arrangement.",
            "Data must be kept only for as long as needed, in line with the retention schedule.",
            "Company equipment must be returned within five working days of leaving employment.",
            "Claims for mileage must state the start and end point of each journey and its business purpose.",
            "Visitors must be signed in at reception and accompanied while in operational areas.",
            "Purchases above {money_small} require at least three written quotes unless a framework agreement applies.",
            "Any loss of a laptop, phone or access badge must be reported to IT within 24 hours.",
        ], "actions"),
        (["Responsibilities", "Roles and Responsibilities"], "para", [
            "Managers are responsible for making sure their teams understand the policy and for dealing with breaches fairly.",
            "The {dept} team maintains the policy, provides advice and monitors compliance through periodic checks.",
            "Every employee is responsible for reading the policy and asking for help when they are unsure.",
            "The {role3} reports significant breaches and trends to the audit committee twice a year.",
            "Internal Audit tests compliance with this policy as part of its annual plan.",
            "Human Resources makes sure the policy is included in the induction of every new starter.",
        ], "people"),
        (["Exceptions and Review", "Breaches", "Review"], "para", [
            "Exceptions must be approved in writing by a director and recorded with the reason.",
            "Breaches of this policy may lead to disciplinary action, in line with our disciplinary procedure.",
            "The policy will be reviewed at least every {months} months, or sooner if the law changes.",
            "Questions about this policy should be sent to {person}.",
            "Changes to this policy are approved by the executive committee and announced on the intranet.",
            "Earlier versions are kept for {years} years in the document management system.",
        ], "closing"),
    ],
}
T_MINUTES = {
    "titles": ["Minutes of the {meeting_name}, {date}", "{meeting_name}: Meeting Minutes", "Notes from the {meeting_name} held on {date}"],
    "meta": ["Present: {person}, {person2}, {person3}, {person4}", "Apologies: {person5}", "Chair: {person}"],
    "sections": [
        (["1. Previous Actions", "1. Matters Arising"], "para", [
            "The minutes of the previous meeting were approved without changes.",
            "{p2_first} confirmed that the supplier price review had been completed and shared with Finance.",
            "The action to update the onboarding checklist remains open and has been carried forward to next month.",
            "{p3_first} reported that the new shift rota had been agreed with employee representatives.",
            "All actions from the last meeting were closed except the review of courier contracts.",
            "{p4_first} confirmed that the new visitor sign-in process is now working at all sites.",
            "The training plan for supervisors was circulated and no comments were received.",
        ], "actions"),
        (["2. Performance Review", "2. Monthly Figures"], "para", [
            "{p1_first} presented the monthly figures, noting that revenue was {pct_small} ahead of budget.",
            "The meeting discussed the rise in customer complaints at {site}, which was linked to a new packing line.",
            "{p4_first} explained that delivery performance had dipped in the second week because of staff absence.",
            "Members agreed that the current targets remain appropriate and should not be changed mid-year.",
            "There was a long discussion about overtime, and the meeting asked for a breakdown by team for next time.",
            "It was noted that the debtor position had improved, with overdue balances down to {money_small}.",
            "{p3_first} pointed out that the figures for {site2} include a one-off credit that flatters the result.",
            "The meeting asked for next month's pack to include a comparison with the same month last year.",
            "Members welcomed the improvement in safety performance and asked that the teams involved be thanked.",
        ], "numbers"),
        (["3. {topic_title}", "3. Update on {topic_title}"], "para", [
            "{p3_first} gave an update on {topic}, explaining that the pilot at {site} had produced encouraging results.",
            "Members raised concerns about the cost of extending the approach to all sites, estimated at {money}.",
            "The meeting agreed to continue the pilot for a further {weeks} weeks before making a decision.",
            "{p2_first} asked whether customers had been consulted, and it was agreed that a short survey would be sent.",
            "It was decided that {dept} would lead the work, with support from {dept2}.",
            "The chair summarised the discussion and thanked {p3_first} for a clear and well-prepared update.",
            "{p4_first} noted that the approach had worked well at another company and offered to share contacts there.",
            "Some members felt that the benefits had been overstated, and asked for a more cautious estimate.",
            "It was agreed that a decision paper would come to the next meeting.",
        ], "risk"),
        (["4. Any Other Business", "4. AOB"], "para", [
            "{p4_first} reminded members that the office will close early on {weekday} for building maintenance.",
            "The date of the summer team event was confirmed as {date}.",
            "No other business was raised.",
            "{p2_first} noted that the fire drill is scheduled for next month and asked team leaders to remind staff.",
        ], "people"),
        (["Actions", "Action Items"], "bullets", [
            "{p1_first} to circulate the revised budget by {date}.",
            "{p2_first} to contact {supplier} about the delayed shipment and report back by {weekday}.",
            "{p3_first} to prepare a cost comparison for the {site} pilot.",
            "{p4_first} to update the risk register with the points raised today.",
            "All members to send comments on the draft plan to {p1_first} within {days} days.",
            "{p3_first} and {p4_first} to meet the IT team about access to the {system}.",
            "{p1_first} to book the room for the next meeting and send the agenda a week in advance.",
            "{p4_first} to share the draft customer survey with members by {weekday}.",
        ], None),
    ],
    "footer": ["Next meeting: {date2} at {clock}, {site} meeting room 2.", "The meeting closed at {clock}."],
}
T_PRODUCT = {
    "titles": ["{product_title}: Product Overview", "Introducing the {product_title}", "{product_title} Product Sheet"],
    "meta": [],
    "sections": [
        (["Overview"], "para", [
            "The {product} is designed for [small businesses|busy teams|professional users|facility managers] who need reliability without complexity.",
            "It builds on the success of the previous model, with improvements suggested directly by customers.",
            "Since its launch in {month}, more than {bignum} units have been sold across {num_small} countries.",
            "The {product} combines a compact design with the durability needed for daily use.",
            "It is made by {company} at our {site} facility, where every unit is tested before shipment.",
            "Customers told us they wanted something simpler to install and easier to maintain, and this model delivers both.",
            "The design team spent {months} months testing prototypes with real users before finalising the design.",
        ], None),
        (["Key Features", "Features"], "bullets", [
            "Set-up takes less than {mins} minutes, with no special tools required.",
            "Energy use is about {pct} lower than the previous generation.",
            "A clear status display shows at a glance whether everything is working as expected.",
            "The housing is made from {pct_high} recycled material and can be fully recycled at end of life.",
            "Remote monitoring is included through the {company} customer portal at no extra cost.",
            "Spare parts and consumables are available for at least seven years after purchase.",
            "Quiet operation, below {db} decibels in normal use.",
            "Compatible with the most common building management and office systems.",
            "Tool-free access to all parts that need routine cleaning or replacement.",
            "Automatic alerts by email or text when attention is needed.",
            "Available in three finishes to suit different settings.",
            "Firmware updates are delivered automatically and never require a site visit.",
        ], None),
        (["Specifications", "Technical Details"], "bullets", [
            "Dimensions: {dim1} x {dim2} x {dim3} millimetres.",
            "Weight: {kg} kilograms.",
            "Power supply: {volts} volts, with automatic standby after {mins} minutes without use.",
            "Operating temperature: 0 to {temp} degrees Celsius.",
            "Warranty: {years} years, extendable on request.",
            "Certifications: meets the relevant safety and electromagnetic compatibility standards.",
        ], None),
        (["Typical Uses", "Who It Is For"], "para", [
            "Customers in hospitality use the {product} to keep guest areas comfortable while controlling running costs.",
            "Warehouse operators value its robustness and the ability to check status remotely.",
            "Office managers choose it because it needs very little attention once installed.",
            "In a recent trial with {customer}, the {product} reduced maintenance visits by {pct}.",
            "It is also suitable for home offices, where space and noise levels matter.",
            "Schools and libraries appreciate the low running costs and quiet operation.",
            "Retail chains use it across many stores because it can be managed centrally.",
            "Small workshops find that it stands up well to dust and frequent handling.",
        ], "customer"),
        (["Support and Warranty", "Ordering and Support"], "para", [
            "Every {product} comes with a {years}-year warranty covering parts and labour.",
            "Our support team answers calls within {mins} minutes on average during business hours.",
            "Orders placed before {clock} on a working day are dispatched the same day.",
            "Volume pricing is available for orders of more than {num} units; please ask your account manager.",
            "Training videos and installation guides are available free of charge on our website.",
            "Extended support plans include a replacement unit within one working day if a fault occurs.",
        ], "closing"),
    ],
}
T_INCIDENT = {
    "titles": ["Incident Review: {ticket} ({system} outage)", "Post-Incident Report for {ticket}",
               "Incident {ticket}: {incident_title}"],
    "meta": ["Date of incident: {date}", "Severity: {sev}", "Author: {person}, {role1}", "Status: {inc_status}"],
    "sections": [
        (["Summary"], "para", [
            "On {date}, the {system} was unavailable for {hours} hours, preventing staff at {site} from processing orders.",
            "The incident was caused by a configuration change that had not been tested against production data.",
            "About {num} customers were affected, and {num_small} orders were delayed by more than one day.",
            "No data was lost, and all affected transactions were recovered and processed by the next morning.",
            "This review follows our blameless format: the aim is to understand and improve, not to assign fault.",
            "The incident lasted from the first alert until full recovery, a period of just over {hours} hours.",
            "A similar but smaller incident occurred {months} months ago, and this review looks at both.",
        ], "numbers"),
        (["Timeline"], "bullets", [
            "{tl} Monitoring raised an alert for slow responses from the {system}.",
            "{tl} The on-call engineer, {person2}, acknowledged the alert and began investigating.",
            "{tl} Staff at {site} reported that they could not save new orders.",
            "{tl} The incident was escalated to severity {sev_num} and a bridge call was opened.",
            "{tl} The team identified the configuration change deployed earlier that day as the likely cause.",
            "{tl} The change was rolled back and services began to recover.",
            "{tl} All queued transactions had been processed and the incident was declared resolved.",
            "{tl} Customer Service sent an update to affected customers.",
        ], None),
        (["Impact"], "para", [
            "Order processing at {site} stopped completely for most of the afternoon.",
            "Customer Service received {num} additional calls, and the average wait time rose to {mins} minutes.",
            "We estimate the direct cost of the incident, including overtime and expedited shipping, at {money_small}.",
            "Two key customers, including {customer}, received their deliveries a day late.",
            "There was no impact on payment data or personal information.",
            "Staff at {site} spent around {num} hours re-entering orders after the system came back.",
            "Several customers asked for written confirmation of their order status, which added to the workload.",
            "Our service level with {customer} was missed for the day, which may lead to a small service credit.",
        ], "customer"),
        (["Root Cause", "What Happened"], "para", [
            "The configuration change reduced the number of database connections available to the {system}.",
            "Testing had been carried out in an environment with far less data than production, so the problem did not appear there.",
            "The change was approved through the normal process, but the review checklist did not ask about load testing.",
            "Monitoring detected the symptoms quickly, but the alert did not point clearly to the underlying cause.",
            "A contributing factor was that the engineer who made the change was not on call when the problem appeared.",
            "Documentation for the connection settings was out of date, so the risk of the change was not obvious.",
            "The change was made late in the day, which left little time to observe its effect before the busy period.",
            "There was no automatic check that compared the new settings with the expected production load.",
        ], "risk"),
        (["What Went Well"], "para", [
            "The on-call process worked as designed, and the right people joined the bridge call within {mins} minutes.",
            "Staff at {site} switched to the paper fallback procedure without being asked.",
            "Communication with customers was clear and timely.",
            "The rollback was quick once the cause was identified, and it worked first time.",
            "Colleagues from other teams offered help without being asked, which shortened the recovery.",
        ], "people"),
        (["Corrective Actions", "Follow-up Actions"], "bullets", [
            "Add a load-testing step to the change checklist for the {system} (owner: {p2_first}, due {date2}).",
            "Refresh the test environment with a realistic volume of data every month (owner: {p3_first}).",
            "Improve the alert so that it shows connection pool usage directly (owner: {p2_first}).",
            "Require that the author of a change is reachable for {hours} hours after deployment.",
            "Rehearse the paper fallback procedure at every site twice a year (owner: {p4_first}).",
            "Review this incident at the next operations meeting and confirm all actions are on track.",
            "Update the customer communication templates so that they can be sent within {mins} minutes of an incident being declared.",
            "Share this review with all engineering teams as a learning example.",
        ], None),
    ],
}
T_CONTRACT = {
    "titles": ["Plain-Language Guide to the {agreement} with {supplier}", "What Our {agreement} with {customer} Means",
               "Contract Summary: {agreement} ({contract_ref})"],
    "meta": ["Prepared by: {person}, {role1}", "Contract reference: {contract_ref}"],
    "sections": [
        (["What the Agreement Covers", "Overview"], "para", [
            "This note explains, in plain language, the main terms of our {agreement} with {supplier}.",
            "It is not a substitute for the contract itself, which takes priority if there is any difference.",
            "The agreement covers the supply of {service} to all of our sites, including {site} and {site2}.",
            "It was signed on {date} after about {months} months of negotiation.",
            "The total expected value over the initial term is {money}.",
            "Both the commercial and legal teams reviewed the final draft before signature.",
            "The agreement uses the supplier's standard terms, with a schedule of changes that we negotiated.",
        ], None),
        (["Term and Renewal", "How Long It Lasts"], "para", [
            "The initial term is {years} years, starting on {date2}.",
            "After that, the agreement renews automatically for periods of twelve months unless either side gives notice.",
            "Notice of non-renewal must be given at least {days} days before the end of the current term.",
            "We should put the notice date in the contract calendar now, so that it is not missed.",
            "A review meeting must take place at least six months before the end of the term to discuss renewal.",
            "Either side may propose changes to the scope at the annual review, but changes need written agreement.",
        ], "risk"),
        (["Prices and Payment", "Fees"], "para", [
            "Prices are fixed for the first year and can then rise each year by no more than inflation plus {pct_small}.",
            "Invoices are issued monthly in arrears and must be paid within {days} days.",
            "If we pay late, the supplier may charge interest, so invoices should be approved promptly.",
            "Volume discounts apply once annual spending passes {money_small}.",
            "Any work outside the agreed scope must be approved in writing before it starts, or we do not have to pay for it.",
            "Disputed invoices can be withheld, but only the disputed amount, and we must explain why in writing.",
            "Expenses such as travel are only payable if they were agreed in advance.",
            "The supplier must give {days} days' notice of any price change allowed under the agreement.",
        ], "numbers"),
        (["Service Levels", "What We Can Expect"], "para", [
            "The supplier must meet a service level of {pct_high} on-time performance, measured monthly.",
            "If the service level is missed, we receive service credits of up to {pct_small} of the monthly fee.",
            "Service credits are our main remedy for poor performance, so it matters that we record failures accurately.",
            "Urgent faults must be answered within {hours} hours, every day of the year.",
            "Performance is reviewed at a monthly meeting, using a report that the supplier prepares.",
            "If performance falls short, the supplier must produce an improvement plan within two weeks.",
            "We must tell the supplier about faults promptly, otherwise the response clock does not start.",
        ], "customer"),
        (["Liability and Termination", "Ending the Agreement"], "para", [
            "Each party's total liability is capped at {pct_cap} of the fees paid in the previous twelve months, with the usual exceptions for fraud and personal injury.",
            "We can end the agreement early if the supplier misses the service level in three consecutive months.",
            "Either side can terminate for a serious breach that is not put right within {days} days of written notice.",
            "On termination, the supplier must help us move the service to a new provider for up to {months} months.",
            "Confidentiality obligations continue for {years} years after the agreement ends.",
            "We are not allowed to recruit the supplier's staff working on our account for twelve months after the end of the agreement.",
            "The supplier must return or destroy our data at the end of the agreement and confirm this in writing.",
        ], "actions"),
    ],
}
T_FINANCE = {
    "titles": ["Finance Commentary: {month} {year}", "{company} Management Accounts Commentary, {quarter} {year}",
               "Monthly Finance Update for {month} {year}"],
    "meta": ["Prepared by {person}, {role1}"],
    "sections": [
        (["Headlines", "Key Points"], "bullets", [
            "Revenue of {money}, {pct_small} ahead of budget and {pct} up on last year.",
            "Gross margin of {margin}, {margin_delta} percentage points better than plan.",
            "Operating expenses {pct_small} over budget, driven by temporary staff and IT licences.",
            "Cash at month end of {money}, with no use of the overdraft facility.",
            "Full-year forecast unchanged.",
            "Net debt reduced by {money_small} in the month.",
            "Headcount of {num}, {num_small} below budget.",
        ], None),
        (["Revenue"], "para", [
            "Revenue was helped by strong sales of the {product} and a one-off project for {customer}.",
            "Recurring revenue now makes up {pct} of the total, which improves the predictability of our income.",
            "Sales in the {region} region were below budget because a large order slipped into next month.",
            "Excluding the one-off project, underlying growth was {pct_small}.",
            "Price increases contributed about half of the growth, with volumes providing the rest.",
            "Service revenue grew faster than product revenue, and now accounts for {pct} of the total.",
            "Credit notes issued in the month were unusually high because of a pricing error that has since been corrected.",
            "Deferred revenue increased as more customers paid annually in advance.",
        ], "customer"),
        (["Margin and Costs", "Gross Margin"], "para", [
            "Gross margin benefited from lower material prices and a better product mix.",
            "Freight costs remain high and reduced margin by about {margin_delta} percentage points.",
            "Payroll costs were in line with budget, but agency spending was {money_small} above plan.",
            "Marketing spending was deliberately held back until the autumn campaign.",
            "IT costs rose because licences for the new {system} were paid annually in advance.",
            "Property costs were flat, although the rent review at {site} is due next quarter.",
            "Bad debt provisions were released after two long-standing disputes were settled.",
            "Travel costs remain well below pre-pandemic levels, and we do not expect them to recover fully.",
            "Depreciation rose following the commissioning of new equipment at {site2}.",
        ], "numbers"),
        (["Cash and Working Capital", "Cash Flow"], "para", [
            "Operating cash flow was {money_small}, ahead of plan because customers paid more promptly.",
            "Debtor days fell to {days}, the best figure for two years, after the credit control team chased older balances.",
            "Inventory rose by {money_small} as we built stock ahead of the seasonal peak.",
            "Creditor days were stable, and all suppliers were paid within agreed terms.",
            "Capital expenditure in the month was {money_small}, mainly on equipment for {site}.",
            "The quarterly tax payment of {money_small} was made on time.",
            "Cash conversion, measured as operating cash flow over operating profit, was {pct_high} over the last twelve months.",
        ], "risk"),
        (["Outlook", "Forecast"], "para", [
            "We are keeping the full-year forecast unchanged, as the strong month is partly a matter of timing.",
            "The main risks to the forecast are freight costs and the timing of the {customer} renewal.",
            "We will present an updated forecast with the {quarter} results.",
            "Budget holders are reminded to submit accruals by the third working day of next month.",
            "The budget process for next year will start in {month}, with templates issued to budget holders by {date}.",
            "We will also bring a proposal on hedging foreign currency purchases to the next board meeting.",
        ], "actions"),
    ],
}
T_STATUS = {
    "titles": ["{project}: Status Report for Week {week}", "{project} Project Update ({month} {year})",
               "Status Update: {project}"],
    "meta": ["Project manager: {person}", "Sponsor: {person2}, {role2}", "Overall status: {rag}"],
    "sections": [
        (["Summary"], "para", [
            "{project} aims to [replace the old {system} with a modern platform|consolidate three regional versions of the {system} into one|move the {system} to a cloud service|automate the manual steps around the {system}] by the end of {month}.",
            "Overall the project is rated {rag}: [most workstreams are on track, but data migration is behind|design and build are on schedule, while testing has started late|scope is stable, but two key roles are still being filled|the budget is under control, but the timeline is tight].",
            "[Spending|Expenditure|Cost] to date is {money_small}, [which is|representing|or] {pct} of the approved budget.",
            "The steering group met on {date} and approved the revised plan for the testing phase.",
            "User feedback on the prototype has been positive, especially on the simpler approval screens.",
            "The main concern remains the quality of the data to be migrated.",
        ], "numbers"),
        (["Progress This Period", "Completed This Week"], "bullets", [
            "Completed the design of the new [approval workflow|reporting pack|order screens|supplier onboarding flow] with the {dept} team.",
            "Ran {num_small} user workshops at {site} and collected feedback on the prototype.",
            "Migrated {pct} of [supplier|customer|product|employee] records to the new platform, with error checks passed.",
            "Signed the statement of work with the implementation partner, {supplier}.",
            "Finished the first round of integration testing with the finance system.",
            "Agreed the training plan, including short videos and drop-in sessions.",
            "Set up the test environment with a full copy of last month's data.",
            "Confirmed the cut-over weekend with the business and the implementation partner.",
            "Closed {num_small} of the open design questions, leaving two for the steering group.",
        ], None),
        (["Milestones", "Upcoming Milestones"], "bullets", [
            "User acceptance testing [starts|begins] on {date} ([on track|at risk|on track]).",
            "Training for super-users completes by {date2} (at risk).",
            "Go-live at the first site planned for {month} (on track).",
            "Decommissioning of the old system after {months} months of parallel running.",
        ], None),
        (["Risks and Issues"], "para", [
            "[Data quality in the old system is worse than expected|Many old records are incomplete or duplicated], and cleaning [it|them] is taking longer than planned.",
            "Two key users from {dept} are also needed for year-end work, which limits their availability for testing.",
            "The implementation partner has replaced its lead consultant, which has [caused some delay in decisions|slowed down design sign-off|meant repeating two workshops].",
            "If migration slips by more than {weeks} weeks, the go-live date will need to move.",
            "The budget contingency has been partly used to cover extra consultant days.",
            "Some users are worried that the new system will add work, and we are addressing this through early demonstrations.",
            "A dependency on a new network link at {site} has not yet been confirmed by the provider.",
        ], "risk"),
        (["Decisions Needed", "Requests to the Steering Group"], "para", [
            "The steering group is asked to approve an additional {money_small} for [temporary data-cleaning support|an extra test cycle|external training support|a short extension of the partner contract].",
            "We recommend that the second site goes live four weeks after the first rather than in parallel.",
            "We need a decision on whether historic records older than {years} years will be migrated or archived.",
            "We ask sponsors to release key users for three days of testing in {month}.",
            "We recommend freezing changes to the old system from {date} to reduce migration risk.",
        ], "actions"),
    ],
}
T_SUPPLIER = {
    "titles": ["Supplier Evaluation: {supplier}", "Annual Supplier Review for {supplier}", "{supplier}: Performance Assessment {year}"],
    "meta": ["Category: {category}", "Reviewed by: {person}, {role1}", "Annual spend: {money}"],
    "sections": [
        (["Background"], "para", [
            "{supplier} has supplied {category} to {company} since {year_old}, mainly to our {site} site.",
            "It is one of our {num_small} strategic suppliers and accounts for {pct} of spending in its category.",
            "This review covers the twelve months to {month} and follows our standard scorecard.",
            "The relationship is managed by {person2} in Procurement, with monthly review calls.",
            "The supplier employs about {num} people and operates from two sites.",
            "We last reviewed the supplier in detail {years} years ago, when it was rated acceptable.",
        ], None),
        (["Delivery Performance", "Delivery"], "para", [
            "On-time delivery averaged {pct_high}, slightly below the contract target of {pct_target}.",
            "Most late deliveries occurred in {month}, when the supplier was moving to a new warehouse.",
            "Lead times have been stable at about {days} days for standard items.",
            "The supplier gives good advance warning of delays, which helps our planning team.",
            "Urgent orders were usually delivered within two working days, which our sites value highly.",
            "Paperwork errors on delivery notes caused some delays at goods receipt.",
        ], "numbers"),
        (["Quality"], "para", [
            "We rejected {num_small} deliveries out of {num} received, mostly for damaged packaging rather than faulty goods.",
            "One quality issue in {month} required a full sort of stock at {site}, which the supplier paid for.",
            "Certificates of conformity are provided with every delivery and are generally accurate.",
            "The supplier's own quality audit results, which they shared voluntarily, were good.",
            "Corrective actions from last year's audit were all closed on time.",
            "Complaints about the supplier from our own sites fell to {num_small} this year.",
        ], "risk"),
        (["Cost and Commercial Terms", "Commercial"], "para", [
            "Prices increased by {pct_small} this year, below the general rate of inflation for the category.",
            "Payment terms are {days} days, which is in line with our standard terms.",
            "The supplier agreed to hold prices for six months in return for a volume commitment.",
            "Invoices are usually accurate, although a few duplicates were found in the quarterly check.",
            "Compared with two alternative suppliers, prices are competitive for standard items but high for specials.",
            "The supplier has offered a rebate of {pct_small} if annual spend passes {money_small}.",
        ], "numbers"),
        (["Recommendation", "Overall Assessment"], "para", [
            "Overall, {supplier} remains a reliable partner, and we recommend renewing the agreement for a further {years} years.",
            "We recommend keeping {supplier} as the main supplier but qualifying a second source for critical items.",
            "The supplier should be asked for a written improvement plan covering delivery performance.",
            "We will repeat this review in twelve months, with a short interim check after six.",
            "The category team will run a market test next year to confirm that prices remain competitive.",
            "Any renewal should include clearer delivery targets and a simple service credit mechanism.",
        ], "actions"),
    ],
}
T_KB = {
    "titles": ["Help Article: {kb_problem}", "How to Fix: {kb_problem}", "Support Guide: {kb_problem}"],
    "meta": ["Applies to: {device}", "Last updated: {date}"],
    "sections": [
        (["The Problem", "Symptoms"], "para", [
            "Some customers have reported that the {device} stops responding after a software update.",
            "[You may see|The screen may show|The app may display] an error message saying that the device [cannot connect to|is unable to reach|has lost contact with] the service.",
            "The problem [usually|tends to] [appear|appears] after [a power cut|a power interruption|the device has been unplugged] or when [the network settings change|the router is replaced|the office network is reconfigured].",
            "[In most cases|Almost always|Usually], no data is lost and the device [works normally|returns to normal operation|behaves as expected] once the steps below [are completed|have been followed].",
            "[The fault|This behaviour|The issue] has been seen on [a small share|a small number|fewer than one in fifty] of devices installed in the last {months} months.",
            "Other devices on the same network are [usually not affected|normally unaffected|rarely affected].",
            "Some users also notice that the mobile app shows an old reading or an empty screen.",
        ], "customer"),
        (["Why It Happens", "Cause"], "para", [
            "The device [keeps|stores] a [local |cached |]copy of its settings, and this copy can [become out of date|go stale|fall out of step with the service] after an update.",
            "[Older routers|Some office firewalls|Certain home routers] [sometimes block|may block|can filter out] the port that the device uses to reach our service.",
            "If the clock on the device is wrong, security checks fail and the connection is refused.",
            "A weak [wireless|Wi-Fi] signal can cause the device to [drop its connection repeatedly|lose its connection every few minutes|disconnect and reconnect in a loop].",
            "In rare cases, an interrupted update leaves the device running an incomplete version of its software.",
            "[Changing|Updating|Resetting] the network name or password without [updating the device|entering the new details on the device] will also stop it connecting.",
        ], "risk"),
        (["How to Fix It", "Steps"], "bullets", [
            "[Check|Confirm|Make sure] that the device is powered on and that the status light is [steady rather than flashing|lit and not blinking].",
            "[Restart|Reboot|Power-cycle] the device by holding the power button for {secs} seconds.",
            "Open the [settings menu|Settings screen] and choose [Network, then Reconnect|Connections, then Reset connection].",
            "If [asked|prompted], enter the [code|six-digit code|pairing code] printed on the label [on the back|underneath|on the side] of the device.",
            "[Wait|Allow] up to {mins} minutes for the device to [download|fetch|retrieve] its latest settings.",
            "[Sign in to|Log in to|Open] the customer portal and [confirm|check] that the device shows as [online|connected].",
            "[Move the device closer to the router|Bring the router and the device closer together], or add a signal booster, if the signal indicator shows [one bar or less|a weak signal].",
            "[Check|Verify] that the date and time shown in the settings menu are correct[, and correct them if not|].",
            "If an update is [offered|available], install it and do not switch the device off until it has [finished|completed].",
        ], None),
        (["If This Does Not Work", "Still Need Help?"], "para", [
            "If the device [still does not connect|remains offline|is still not working], please [contact|call|ring] our support team on {phone}, quoting [your serial number|the serial number on the label].",
            "You can also [open a ticket|raise a request|log a case] through the customer portal; most [tickets|requests] receive a [reply|response] within {hours} working hours.",
            "Please do not [return|send back] the device before speaking to support, as most problems can be [solved|fixed|resolved] remotely.",
            "If the device is [under warranty|still covered by its warranty], we will replace it [free of charge|at no cost] if it cannot be repaired.",
            "Before [calling|you call], please note the colour and pattern of the status light, as this [helps us diagnose|lets us identify|speeds up diagnosis of] the fault.",
            "Our [community forum|user forum|online help centre] also has tips from other users who have solved similar problems.",
        ], "closing"),
    ],
}
T_HR = {
    "titles": ["Announcement: Changes to {hr_topic}", "HR Update: {hr_topic}", "{company} People Update: {hr_topic}"],
    "meta": ["From: {person}, {role1}", "Date: {date}"],
    "sections": [
        (["What Is Changing", "Summary"], "para", [
            "From {date2}, we are making changes to {hr_lower} that affect all permanent employees.",
            "The changes follow feedback from the staff survey, in which {pct_high} of respondents asked for more flexibility.",
            "We have worked closely with employee representatives to design the new arrangements.",
            "The company will invest about {money} in these changes over the next year.",
            "The new arrangements will be reviewed after twelve months to check that they are working as intended.",
            "Part-time colleagues will receive the same benefits on a pro-rata basis.",
        ], "people"),
        (["Details", "The New Arrangements"], "bullets", [
            "Annual leave entitlement increases by one day after {years} years of service.",
            "Employees can buy up to five additional days of leave each year through salary sacrifice.",
            "Core hours will be from {clock} to 15:00, with flexible start and finish times around them.",
            "Employer pension contributions rise to {pct_small} of salary for employees who contribute at least the same.",
            "Every employee will have a personal development budget of {money_small} per year.",
            "Parents returning from leave can work reduced hours for up to {months} months without a change to their contract.",
            "The cycle-to-work scheme is being extended to include electric bicycles.",
            "Employees with more than {years_long} years of service will receive an additional long-service award.",
            "An employee assistance programme offers free, confidential advice by phone at any time.",
            "Paid volunteering leave of two days a year is available for work with registered charities.",
            "Sick pay arrangements are unchanged.",
        ], None),
        (["What You Need to Do", "Next Steps"], "para", [
            "You do not need to do anything unless you want to take up one of the optional schemes.",
            "To apply, complete the form on the {system} before {date}.",
            "Managers will discuss the changes with their teams at the next team meeting.",
            "Information sessions will be held at {site} on {weekday} and online the following week.",
            "If you are on leave at the moment, your manager will contact you when you return.",
            "Please check that your personal details in the {system} are up to date.",
        ], "actions"),
        (["Questions", "Further Information"], "para", [
            "A full set of frequently asked questions is available on the HR portal.",
            "If your situation is not covered, please speak to your HR Business Partner.",
            "We hope these changes make working at {company} more rewarding.",
            "Employee representatives can also help if you would prefer to raise a question through them.",
        ], "closing"),
    ],
}
T_PROPOSAL = {
    "titles": ["Proposal Summary for {customer}", "{company} Proposal: {service_title} for {customer}",
               "Summary of Our Offer to {customer}"],
    "meta": ["Prepared by: {person}, {role1}", "Valid until: {date}"],
    "sections": [
        (["Your Requirements", "Understanding Your Needs"], "para", [
            "{customer} is looking for a partner to provide {service} across {num_small} locations.",
            "Your main goals are to reduce cost, improve reliability and get clearer reporting.",
            "You told us that the current provider often misses agreed response times, especially at weekends.",
            "The solution must also support your plans to open two new sites next year.",
            "You also want a single point of contact rather than separate teams for each location.",
            "Budget approval is expected in {month}, with a decision on the supplier shortly afterwards.",
        ], "customer"),
        (["Our Proposed Solution", "What We Propose"], "para", [
            "We propose a single managed service, run from our {site} centre, with a named account manager.",
            "A dedicated team of {num_small} specialists will be assigned to your account.",
            "Monthly reports will show performance against every service level, site by site.",
            "We will begin with a {weeks}-week transition period, during which both providers run in parallel.",
            "Our approach has been used successfully with similar customers in the {region} region.",
            "Service will be available seven days a week, with out-of-hours cover for urgent requests.",
            "We will use your existing ticketing process where possible, so your staff do not need to learn a new system.",
            "Quarterly business reviews will look at trends and suggest improvements, not just report past performance.",
        ], "actions"),
        (["Pricing", "Commercial Summary"], "bullets", [
            "Monthly service fee: {money_small}, fixed for the first {years} years.",
            "One-off transition fee: {money_small}, payable in two instalments.",
            "Optional weekend cover: {money_small} per month.",
            "Payment terms: {days} days from invoice.",
            "Prices exclude VAT.",
        ], None),
        (["Timeline", "Implementation Plan"], "para", [
            "Following contract signature, we can begin the transition within {days} days.",
            "Full service would start on {date2}, subject to access to your sites and systems.",
            "A joint review at the end of the first three months will confirm that everything is working as expected.",
            "We will agree a detailed transition plan with your team in the first two weeks.",
            "Staff currently working on your account may transfer to us, subject to the usual legal process.",
        ], "risk"),
        (["Why {company}", "Why Choose Us"], "para", [
            "We have provided similar services for more than {years_long} years and retain {pct_high} of our customers each year.",
            "Our service levels are backed by meaningful service credits, not just promises.",
            "We would welcome the chance to show you our {site} centre and introduce the team.",
            "References from current customers of a similar size are available on request.",
            "We are happy to discuss any part of this proposal and adjust it to your needs.",
        ], "closing"),
    ],
}
DOC_TYPES = {
    "report": T_REPORT, "memo": T_MEMO, "email": T_EMAIL, "policy": T_POLICY, "minutes": T_MINUTES,
    "product": T_PRODUCT, "incident": T_INCIDENT, "contract": T_CONTRACT, "finance": T_FINANCE,
    "status": T_STATUS, "supplier": T_SUPPLIER, "kb": T_KB, "hr": T_HR, "proposal": T_PROPOSAL,
}

POLICY_NAMES = ["Expenses", "Information Security", "Gifts and Hospitality", "Flexible Working", "Data Retention",
                "Travel", "Remote Working", "Conflicts of Interest", "Acceptable Use", "Procurement"]
MEETING_NAMES = ["Operations Committee", "Monthly Leadership Meeting", "Site Managers' Meeting",
                 "Customer Service Review", "Health and Safety Committee", "Product Steering Group", "Finance Review"]
AGREEMENTS = ["Master Services Agreement", "Supply Agreement", "Maintenance Contract", "Logistics Services Agreement",
              "Software Licence and Support Agreement", "Cleaning Services Contract"]
SERVICES = ["facilities maintenance", "outbound logistics", "IT support", "office cleaning", "payroll processing",
            "equipment servicing", "warehouse staffing", "document storage"]
CATEGORIES = ["packaging materials", "industrial gases", "electronic components", "office supplies",
              "temporary labour", "freight services", "raw ingredients", "spare parts"]
KB_PROBLEMS = ["Device Shows Offline After Update", "Status Light Keeps Flashing", "Device Will Not Pair With the App",
               "Readings Stop Updating", "Software Update Fails", "Device Restarts Repeatedly"]
DEVICES = ["TrackPoint fleet tracker", "Beacon smart thermostat", "Sentinel door sensor", "Cirrus air purifier",
           "Pulse patient monitor", "Keystone access badge reader", "NovaPrint label printer", "PocketPay card reader"]
HR_TOPICS = ["Annual Leave and Flexible Working", "Pension and Benefits", "Learning and Development Support",
             "Working Hours", "Family Leave"]
INCIDENT_TITLES = ["Order Processing Outage", "Delayed Payroll File", "Warehouse Scanner Failure",
                   "Portal Login Errors", "Duplicate Invoices Sent"]


# Word-level variation applied to template text (never inside {slots}); each match is replaced
# by one alternative chosen at random.  Only swaps that keep the grammar intact are listed.
SYNONYMS: list[tuple[str, list[str]]] = [
    (r"\babout(?= \{)", ["about", "roughly", "around", "approximately", "some"]),
    (r"\bmore than(?= \{)", ["more than", "over", "in excess of"]),
    (r"\bbecause of\b", ["because of", "due to", "owing to", "as a result of"]),
    (r"\b(?:mainly|mostly)\b", ["mainly", "mostly", "largely", "chiefly", "primarily"]),
    (r"\bparticularly\b", ["particularly", "especially", "notably"]),
    (r"\busually\b", ["usually", "normally", "typically", "generally"]),
    (r"\boften\b", ["often", "frequently", "regularly"]),
    (r"\bslightly\b", ["slightly", "marginally", "a little"]),
    (r"\bsignificant\b", ["significant", "considerable", "substantial"]),
    (r"\bsignificantly\b", ["significantly", "considerably", "substantially", "markedly"]),
    (r"\bquickly\b", ["quickly", "promptly", "rapidly"]),
    (r"\brose\b", ["rose", "increased", "grew", "climbed"]),
    (r"\bfell\b", ["fell", "dropped", "declined", "decreased"]),
    (r"\breduce\b", ["reduce", "cut", "lower"]),
    (r"\b[Ww]e expect\b", ["we expect", "we anticipate"]),
    (r"\bmake sure\b", ["make sure", "ensure", "check"]),
    (r"\bin line with\b", ["in line with", "consistent with"]),
    (r"\bseveral\b", ["several", "a number of", "some"]),
    (r"\bthe problem\b", ["the problem", "the issue"]),
    (r"\bcustomers\b", ["customers", "clients"]),
    (r"\bbegan\b", ["began", "started"]),
    (r"\bbegin\b", ["begin", "start"]),
    (r"\bso that\b", ["so that", "so"]),
    (r"\bstrong\b", ["strong", "robust", "solid"]),
    (r"\bmain\b", ["main", "principal", "primary", "key"]),
    (r"\blarge\b", ["large", "big", "sizeable", "major"]),
    (r"\bneeded\b", ["needed", "required"]),
    (r"\bneed to\b", ["need to", "have to"]),
    (r"\bcurrent\b", ["current", "existing", "present"]),
    (r"\bresults\b", ["results", "outcomes", "findings"]),
    (r"\bclosely\b", ["closely", "carefully"]),
    (r"\bbroadly\b", ["broadly", "largely", "generally"]),
    (r"\bcompleted\b", ["completed", "finished"]),
    (r"\bcosts\b", ["costs", "expenses"]),
    (r"\bWe will\b", ["We will", "We intend to", "We plan to"]),
    (r"\bwe have\b", ["we have", "we've"]),
    (r"\bteam\b", ["team", "group"]),
    (r"\bproblems\b", ["problems", "issues", "difficulties"]),
    (r"\bimportant\b", ["important", "essential"]),
    (r"\bchanges\b", ["changes", "adjustments"]),
    (r"\bthis period\b", ["this period", "during the period", "in the period"]),
    (r"\bnext month\b", ["next month", "in the coming month"]),
    (r"\b[Ee]mployees\b", ["employees", "staff", "colleagues"]),
    (r"\bimprove\b", ["improve", "strengthen"]),
    (r"\ba problem\b", ["a problem", "an issue"]),
    (r"\bthe company\b", ["the company", "the business"]),
    (r"\bsites\b", ["sites", "locations"]),
    (r"\bhigher\b", ["higher", "greater"]),
    (r"\bexplained that\b", ["explained that", "noted that", "said that"]),
    (r"\breported that\b", ["reported that", "said that", "noted that"]),
    (r"\bsuggested\b", ["suggested", "proposed"]),
    (r"\bprevious\b", ["previous", "prior", "last"]),
    (r"\b[Pp]lease\b", ["please", "kindly"]),
    (r"\bquestions\b", ["questions", "queries"]),
    (r"\b[Ss]pending\b", ["spending", "expenditure"]),
    (r"\bexpected\b", ["expected", "anticipated"]),
    (r"\bpeople\b", ["people", "colleagues", "staff"]),
    (r"\bimmediately\b", ["immediately", "at once", "straight away"]),
    (r"\bvery\b", ["very", "extremely", "highly"]),
    (r"\bgood\b", ["good", "sound", "solid"]),
    (r"\bwhich is\b", ["which is", "and this is"]),
    (r"\bin advance\b", ["in advance", "ahead of time"]),
]
_SYN_RE = [(re.compile(pat), alts) for pat, alts in SYNONYMS]
# Sentence openers that may follow a connector ("Meanwhile, the ...") once lower-cased.
_LOWERABLE = {"The", "We", "Our", "This", "It", "There", "Most", "Several", "Some", "All", "Each", "Every",
              "Customers", "Staff", "Managers", "Prices", "Revenue", "Spending", "Sales", "Two", "One", "A", "An"}
CONNECTORS = ["In addition, ", "Meanwhile, ", "At the same time, ", "Separately, ", "Notably, ",
              "On a related point, ", "For context, ", "Equally, "]
EXTRA_SECTIONS = [
    (["Risks", "Key Risks", "Risks and Concerns"], "risk"),
    (["People", "Our People", "Team Update"], "people"),
    (["Customers", "Customer Feedback", "Customer View"], "customer"),
    (["Next Steps", "Actions Agreed", "What Happens Next"], "actions"),
    (["Key Figures", "Numbers at a Glance", "Measures"], "numbers"),
    (["Sustainability", "Environment"], "sustain"),
    (["Systems and IT", "Technology"], "tech"),
]
# Relative frequency of each document type (types with larger banks appear more often).
TYPE_WEIGHT = {"report": 2, "memo": 2, "email": 2, "minutes": 2, "finance": 2}
# Target word range per document type (narrow types stay short so documents share fewer sentences).
WORD_RANGE = {"kb": (190, 330), "email": (190, 360), "hr": (200, 420), "contract": (210, 480),
              "product": (200, 460), "proposal": (200, 480), "incident": (240, 560), "policy": (220, 560),
              "minutes": (220, 600)}
EXTRA_SECTION_TYPES = {"report", "memo", "finance", "status", "supplier", "minutes"}


# ------------------------------------------------------------------------------------------
# generation
# ------------------------------------------------------------------------------------------
class Doc:
    """Per-document context: fixed names and a fresh-number generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        r = rng
        self.currency = r.choice(CURRENCIES)
        self.date_style = r.choice(["dmy", "mdy", "iso"])
        self.year = r.choice([2023, 2024, 2025, 2026])
        people = r.sample([(f, l) for f in FIRST for l in LAST], 6)
        roles = r.sample(ROLES, 4)
        companies = r.sample(COMPANIES, 3)
        sites = r.sample(SITES, 2)
        regions = r.sample(REGIONS, 2)
        depts = r.sample(DEPTS, 2)
        wds = r.sample(WEEKDAYS, 2)
        topic = r.choice(TOPICS)
        policy = r.choice(POLICY_NAMES)
        hr = r.choice(HR_TOPICS)
        product = r.choice(PRODUCTS)
        service = r.choice(SERVICES)
        self.clock_min = r.randrange(7 * 60, 16 * 60, 5)
        self.fixed = {
            "company": companies[0], "customer": companies[1], "supplier": companies[2],
            "person": " ".join(people[0]), "person2": " ".join(people[1]), "person3": " ".join(people[2]),
            "person4": " ".join(people[3]), "person5": " ".join(people[4]),
            "p1_first": people[0][0], "p2_first": people[1][0], "p3_first": people[2][0], "p4_first": people[3][0],
            "c_first": people[5][0], "c_full": f"{r.choice(['Ms', 'Mr', 'Dr'])} {people[5][1]}",
            "role1": roles[0], "role2": roles[1], "role3": roles[2],
            "site": sites[0], "site2": sites[1], "region": regions[0], "region2": regions[1],
            "dept": depts[0], "dept2": depts[1], "weekday": wds[0], "weekday2": wds[1],
            "system": r.choice(SYSTEMS), "project": r.choice(PROJECTS), "product": product, "device": r.choice(DEVICES),
            "product_title": product[0].upper() + product[1:],
            "topic": topic, "topic_title": topic[0].upper() + topic[1:],
            "policy_name": policy, "policy_lower": policy.lower(), "hr_topic": hr, "hr_lower": hr.lower(),
            "meeting_name": r.choice(MEETING_NAMES), "agreement": r.choice(AGREEMENTS), "service": service,
            "service_title": service.title(), "category": r.choice(CATEGORIES), "kb_problem": r.choice(KB_PROBLEMS),
            "incident_title": r.choice(INCIDENT_TITLES),
            "quarter": r.choice(["Q1", "Q2", "Q3", "Q4"]), "year": str(self.year), "year_next": str(self.year + 1),
            "year_old": str(self.year - r.randint(3, 15)), "month": r.choice(MONTHS),
            "ticket": f"INC-{r.randint(1000, 9999)}", "order": f"{r.choice(['SO', 'ORD', 'PO'])}-{r.randint(10000, 99999)}",
            "account": f"ACC-{r.randint(100000, 999999)}", "contract_ref": f"{r.choice(['MSA', 'SA', 'MC'])}-{self.year}-{r.randint(100, 999)}",
            "version": f"{r.randint(1, 4)}.{r.randint(0, 9)}", "sev": r.choice(["1 (critical)", "2 (major)", "3 (moderate)"]),
            "sev_num": str(r.randint(1, 2)), "inc_status": r.choice(["Closed", "Actions in progress"]),
            "rag": r.choice(["green", "amber", "amber", "red"]), "week": str(r.randint(2, 50)),
            "phone": f"0{r.randint(1000, 9999)} {r.randint(100000, 999999)}",
            "pct_target": f"{r.choice([95, 96, 97, 98])} percent",
        }

    # fresh values -----------------------------------------------------------------------
    def _money(self, lo: float, hi: float) -> str:
        sym, _ = self.currency
        v = self.rng.uniform(lo, hi)
        if v >= 1_000_000:
            return f"{sym}{v / 1_000_000:.2f} million"
        return f"{sym}{int(round(v, -2)):,}"

    def _date(self) -> str:
        r = self.rng
        m, d = r.randint(1, 12), r.randint(1, 28)
        if self.date_style == "iso":
            return f"{self.year}-{m:02d}-{d:02d}"
        if self.date_style == "mdy":
            return f"{MONTHS[m - 1]} {d}, {self.year}"
        return f"{d} {MONTHS[m - 1]} {self.year}"

    def _pct(self, lo: float, hi: float) -> str:
        v = self.rng.uniform(lo, hi)
        return f"{v:.1f}%" if self.rng.random() < 0.4 else f"{v:.1f} percent"

    def _tl(self) -> str:
        self.clock_min += self.rng.randint(3, 55)
        h, m = divmod(self.clock_min % (24 * 60), 60)
        return f"{h:02d}:{m:02d} -"

    def fresh(self, name: str) -> str:
        r = self.rng
        gens = {
            "pct": lambda: self._pct(2, 35), "pct2": lambda: self._pct(2, 35), "pct_small": lambda: self._pct(0.3, 6),
            "pct_high": lambda: self._pct(82, 99.5), "pct_cap": lambda: f"{r.choice([100, 125, 150, 200])} percent",
            "money": lambda: self._money(250_000, 48_000_000), "money_small": lambda: self._money(1_500, 240_000),
            "num": lambda: str(r.randint(12, 480)), "num2": lambda: str(r.randint(12, 480)),
            "num_small": lambda: str(r.randint(2, 9)), "bignum": lambda: f"{r.randint(1200, 95000):,}",
            "days": lambda: str(r.choice([7, 10, 14, 21, 28, 30, 45, 60, 90])), "days2": lambda: str(r.randint(25, 70)),
            "weeks": lambda: str(r.randint(2, 12)), "months": lambda: str(r.choice([3, 6, 9, 12, 18, 24])),
            "years": lambda: str(r.randint(2, 5)), "years_long": lambda: str(r.randint(8, 40)),
            "hours": lambda: str(r.randint(2, 48)), "mins": lambda: str(r.randint(3, 40)), "mins2": lambda: str(r.randint(3, 40)),
            "secs": lambda: str(r.choice([5, 10, 15, 20, 30])), "date": self._date, "date2": self._date,
            "clock": lambda: f"{r.randint(8, 17):02d}:{r.choice(['00', '15', '30', '45'])}",
            "score": lambda: f"{r.uniform(6.5, 9.4):.1f}", "margin": lambda: f"{r.uniform(18, 62):.1f} percent",
            "margin_delta": lambda: f"{r.uniform(0.2, 3.5):.1f}", "db": lambda: str(r.randint(25, 45)),
            "dim1": lambda: str(r.randint(80, 900)), "dim2": lambda: str(r.randint(60, 600)), "dim3": lambda: str(r.randint(20, 400)),
            "kg": lambda: f"{r.uniform(0.3, 35):.1f}", "volts": lambda: r.choice(["12", "24", "110-240", "230"]),
            "temp": lambda: str(r.choice([35, 40, 45, 50])), "month": lambda: r.choice(MONTHS),
            "tl": self._tl,
        }
        if name not in gens:
            raise KeyError(f"unknown template slot {{{name}}}")
        return gens[name]()

    def vary(self, text: str) -> str:
        """Apply SYNONYMS to literal text (no slots inside), keeping a capital first letter."""
        for rx, alts in _SYN_RE:
            def pick(m: re.Match, alts: list[str] = alts) -> str:
                alt = self.rng.choice(alts)
                return alt[0].upper() + alt[1:] if m.group(0)[0].isupper() else alt
            text = rx.sub(pick, text)
        return text

    def fill(self, template: str) -> str:
        """Resolve ``[a|b]`` choices, vary wording outside slots, then fill ``{slots}``."""
        text = re.sub(r"\[([^\[\]]*\|[^\[\]]*)\]", lambda m: self.rng.choice(m.group(1).split("|")), template)
        parts = re.split(r"(\{\w+\})", text)
        out = []
        for part in parts:
            if part.startswith("{") and part.endswith("}"):
                name = part[1:-1]
                out.append(self.fixed[name] if name in self.fixed else self.fresh(name))
            else:
                out.append(self.vary(part))
        return "".join(out)

    def connect(self, sentence: str) -> str:
        """Sometimes prefix a connector ("Meanwhile, ...") to a mid-paragraph sentence."""
        first = sentence.split(" ", 1)[0]
        if first in _LOWERABLE and self.rng.random() < 0.18:
            return self.rng.choice(CONNECTORS) + sentence[0].lower() + sentence[1:]
        return sentence


def _words(s: str) -> int:
    return len(s.split())


def make_doc(rng: random.Random, kind: str) -> str:
    """One document of type ``kind`` with MIN_WORDS..MAX_WORDS words."""
    spec = DOC_TYPES[kind]
    d = Doc(rng)
    lo, hi = WORD_RANGE.get(kind, (MIN_WORDS + 40, MAX_WORDS - 60))
    target = rng.randint(lo, hi)
    sections = spec["sections"]
    per_sentence = 18
    n_sent = max(2, round(target / per_sentence / (len(sections) + 0.5)))

    # header parts are filled once, before the body, so their fresh values stay fixed
    title = d.fill(rng.choice(spec["titles"]))
    meta = [d.fill(m) for m in spec.get("meta", [])]
    greeting = d.fill(rng.choice(spec["greeting"])) if "greeting" in spec else None

    sections = list(sections)
    if kind in EXTRA_SECTION_TYPES:  # 0-2 optional themed sections before the last one
        for heading_alts, bank_name in rng.sample(EXTRA_SECTIONS, rng.choice([0, 1, 1, 2])):
            sections.insert(len(sections) - 1, (heading_alts, "para", GENERAL[bank_name], None))

    blocks: list[list] = []  # each block: [heading or None, style, sentence, sentence, ...]
    for heading_alts, style, bank, fallback in sections:
        k = max(3 if style == "bullets" else 2, n_sent + rng.randint(-1, 1))
        k = min(len(bank), k)
        # keep the bank's order (openers first) so paragraphs read in a sensible sequence
        chosen = [bank[i] for i in sorted(rng.sample(range(len(bank)), k))]
        if n_sent > len(bank) and fallback:
            chosen += rng.sample(GENERAL[fallback], min(len(GENERAL[fallback]), n_sent - len(bank)))
        heading = d.fill(rng.choice(heading_alts)) if heading_alts else None
        sents = [d.fill(c) for c in chosen]
        if style == "para":
            sents = sents[:1] + [d.connect(x) for x in sents[1:]]
        blocks.append([heading, style] + sents)

    footer = [d.fill(f) for f in spec.get("footer", [])]
    signoff = d.fill(rng.choice(spec["signoff"])) if "signoff" in spec else None

    def render() -> str:
        out = [title]
        if meta:
            out.append("\n".join(meta))
        if greeting:
            out.append(greeting)
        for heading, style, *sents in blocks:
            body = "\n".join(f"- {s}" for s in sents) if style == "bullets" else " ".join(sents)
            out.append(f"{heading}\n{body}" if heading else body)
        out.extend(footer)
        if signoff:
            out.append(signoff)
        return "\n\n".join(out)

    text = render()
    # too long: drop sentences from the longest paragraph blocks (keep >= 1 per block)
    while _words(text) > MAX_WORDS:
        biggest = max((b for b in blocks if len(b) > 3), key=lambda b: _words(" ".join(b[2:])), default=None)
        if biggest is None:
            break
        biggest.pop(rng.randrange(2, len(biggest)))
        text = render()
    # too short: add general sentences to paragraph blocks
    pool = [s for name in ("numbers", "risk", "actions", "customer", "people") for s in GENERAL[name]]
    rng.shuffle(pool)
    para_blocks = [b for b in blocks if b[1] == "para"] or blocks
    i = 0
    while _words(text) < MIN_WORDS and pool:
        para_blocks[i % len(para_blocks)].append(d.fill(pool.pop()))
        i += 1
        text = render()
    return text


def generate(n: int = N_DOCS, seed: int = SEED) -> list[dict]:
    """``n`` rows {"id", "text"}; deterministic for a given seed."""
    master = random.Random(seed)
    kinds = [k for k in DOC_TYPES for _ in range(TYPE_WEIGHT.get(k, 1))]
    order: list[str] = []
    while len(order) < n:
        block = kinds[:]
        master.shuffle(block)
        order.extend(block)
    rows = []
    for i, kind in enumerate(order[:n]):
        rng = random.Random(f"{seed}-{i}-{kind}")
        text = make_doc(rng, kind)
        rows.append({"id": f"cal-{i + 1:04d}", "text": text})
    return rows


def _shingles(text: str, k: int = 5) -> set[tuple[str, ...]]:
    w = re.findall(r"[a-z']+", text.lower())
    return {tuple(w[i:i + k]) for i in range(len(w) - k + 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "calibration.jsonl"))
    ap.add_argument("--n", type=int, default=N_DOCS)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--check", action="store_true", help="print word-count and near-duplicate statistics")
    args = ap.parse_args(argv)

    rows = generate(args.n, args.seed)
    counts = [_words(r["text"]) for r in rows]
    bad = [(r["id"], c) for r, c in zip(rows, counts) if not MIN_WORDS <= c <= MAX_WORDS]
    if bad:
        print(f"word counts out of range: {bad[:10]}", file=sys.stderr)
        return 1
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}; words min {min(counts)} max {max(counts)} "
          f"mean {sum(counts) / len(counts):.0f}")
    if args.check:
        sh = [_shingles(r["text"]) for r in rows]
        worst = (0.0, "", "")
        for i in range(len(sh)):
            for j in range(i + 1, len(sh)):
                inter = len(sh[i] & sh[j])
                if not inter:
                    continue
                jac = inter / len(sh[i] | sh[j])
                if jac > worst[0]:
                    worst = (jac, rows[i]["id"], rows[j]["id"])
        print(f"max pairwise 5-gram Jaccard: {worst[0]:.3f} ({worst[1]} vs {worst[2]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
